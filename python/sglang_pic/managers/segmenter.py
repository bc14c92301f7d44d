"""Cut a prompt into segments at SSEP/PDEP markers and tokenize each segment on its own.

Markers are structure, not tokens: they take no KV slot and no position. The first segment (text before any
marker) is the prefix and alone gets the tokenizer's special prefix tokens (BOS); spans and PDEP text are
tokenized without them, so a span's tokens never depend on its neighbours.
"""

from __future__ import annotations

import re

from sglang_pic.radix_ext.segments import Segment
from sglang_pic.server_args import ServerArgs


class PromptSegmenter:
    def __init__(self, tokenizer, server_args: ServerArgs, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.args = server_args
        self.vocab_size = vocab_size
        self.markers = {server_args.ssep_marker: "span", server_args.pdep_marker: "pdep"}
        self.marker_ids = {server_args.ssep_token_id: "span", server_args.pdep_token_id: "pdep"}
        self._split = re.compile("(" + "|".join(re.escape(m) for m in self.markers) + ")")

    def has_markers(self, text: str) -> bool:
        return any(m in text for m in self.markers)

    def from_text(self, text: str) -> list[Segment]:
        parts = self._split.split(text)
        segments = [Segment("prefix", tuple(self._encode(parts[0], first=True)))]
        for i in range(1, len(parts), 2):
            kind, body = self.markers[parts[i]], parts[i + 1]
            if kind == "span" and not body:
                raise ValueError(f"empty span: the {parts[i]!r} marker at part {i // 2} is followed by no text")
            segments.append(Segment(kind, tuple(self._encode(body, first=False))))
        return self._finish(segments)

    def from_ids(self, ids: list[int]) -> list[Segment]:
        segments: list[Segment] = [Segment("prefix", ())]
        current: list[int] = []
        for tok in ids:
            if tok in self.marker_ids:
                segments[-1] = Segment(segments[-1].kind, tuple(current))
                segments.append(Segment(self.marker_ids[tok], ()))
                current = []
                continue
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"input_ids holds token id {tok}, outside the vocabulary [0, {self.vocab_size})")
            current.append(tok)
        segments[-1] = Segment(segments[-1].kind, tuple(current))
        for i, seg in enumerate(segments):
            if seg.kind == "span" and not seg.token_ids:
                raise ValueError(f"empty span: span marker #{i} in input_ids is followed by no tokens")
        return self._finish(segments)

    def _finish(self, segments: list[Segment]) -> list[Segment]:
        if self.args.disable_pic:
            flat = tuple(t for s in segments for t in s.token_ids)
            segments = [Segment("prefix", flat)]
        if not any(s.token_ids for s in segments):
            raise ValueError("the prompt is empty")
        return segments

    def _encode(self, text: str, first: bool) -> list[int]:
        if not text and not first:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=first))
