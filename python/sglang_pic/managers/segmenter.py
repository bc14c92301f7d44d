"""Cut a prompt into segments at SSEP/PDEP markers and tokenize each segment on its own.

Markers are structure, not tokens: they take no KV slot and no position. The first segment (text before any
marker) is the prefix and alone gets the tokenizer's special prefix tokens (BOS); spans and PDEP text are
tokenized without them, so a span's tokens never depend on its neighbours. That also makes a segment's ids a
function of its text alone, so they are memoized (segment_token_cache): a recurring span is tokenized once.

A span marker may be followed by the span's own quality settings (span_policy.split_settings), which are
structure too: they are cut off the span's text before it is tokenized.

A marker's opening (the marker without its closing punctuation: `<|ssep` of `<|ssep|>`) is reserved: text that
starts one but does not complete it, or a settings marker anywhere but right after a span marker, is refused with
its character position (check_markers). Passed on as text, it would reach the model while the span it meant went
missing, with nothing to tell the client.
"""

from __future__ import annotations

import re
from itertools import chain, pairwise

from sglang_pic.managers.segment_token_cache import SegmentTokenCache
from sglang_pic.radix_ext.segments import Segment
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import split_settings


class PromptSegmenter:
    def __init__(self, tokenizer, server_args: ServerArgs, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.args = server_args
        self.vocab_size = vocab_size
        self.markers = {server_args.ssep_marker: "span", server_args.pdep_marker: "pdep"}
        self.marker_ids = {server_args.ssep_token_id: "span", server_args.pdep_token_id: "pdep"}
        self._split = re.compile("(" + "|".join(re.escape(m) for m in self.markers) + ")")
        self._tokens = SegmentTokenCache(self._tokenize)
        self._names = {
            server_args.ssep_marker: "span marker",
            server_args.pdep_marker: "prompt-dependent marker",
            server_args.span_settings_marker: "span settings marker",
        }
        self._opening_of = {opening: marker for marker in self._names if (opening := _opening(marker))}
        longest_first = sorted(self._opening_of, key=len, reverse=True)  # one opening may start another
        self._openings = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None

    def has_markers(self, text: str) -> bool:
        return any(m in text for m in (*self.markers, self.args.span_settings_marker))

    def from_text(
        self, text: str, known: dict[tuple[str, bool], tuple[int, ...]] | None = None, prefix_specials: bool = True
    ) -> list[Segment]:
        """`known`: segment ids already encoded (see encode_all); `prefix_specials`: the prefix gets BOS."""
        return self.with_settings(text, known, prefix_specials)[0]

    def with_settings(
        self, text: str, known: dict[tuple[str, bool], tuple[int, ...]] | None = None, prefix_specials: bool = True
    ) -> tuple[list[Segment], dict[int, dict]]:
        """The segments of `text` and, by segment index, the settings spans carry (none without PIC)."""
        prefix, parts = self._parts(text)
        segments = [Segment("prefix", self._encode(prefix, prefix_specials, known))]
        settings = {}
        for n, (kind, body, own) in enumerate(parts):
            if kind == "span" and not body:
                raise ValueError(f"empty span: span marker #{n} is followed by no text")
            if own is not None:
                settings[len(segments)] = own
            segments.append(Segment(kind, self._encode(body, False, known)))
        if self.args.disable_pic:
            settings = {}
        return self._finish(segments), settings

    def check_markers(self, text: str) -> None:
        """Refuse (ValueError naming the character position) a marker's opening that does not complete a marker,
        and a span settings marker that does not directly follow a span marker."""
        if self._openings is None:
            return
        ssep, settings = self.args.ssep_marker, self.args.span_settings_marker
        for found in self._openings.finditer(text):
            pos = found.start()
            marker = next((m for m in self._names if text.startswith(m, pos)), None)
            if marker is None:
                meant = self._opening_of[found.group()]
                raise ValueError(
                    f"broken marker at character {pos}: {text[pos : pos + len(meant) + 12]!r} starts the "
                    f"{self._names[meant]} {meant!r} but does not complete it (markers are written exactly: {ssep!r}, "
                    f"{self.args.pdep_marker!r}, {ssep + settings + '{...}'!r})"
                )
            if marker == settings and not text.endswith(ssep, 0, pos):
                raise ValueError(f"span settings ({settings!r}) at character {pos} must follow a span marker "
                                 f"({ssep!r}) directly")

    def _parts(self, text: str) -> tuple[str, list[tuple[str, str, dict | None]]]:
        """The prefix, then (kind, text, own settings) per marker."""
        self.check_markers(text)
        pieces = self._split.split(text)
        out, pos = [], len(pieces[0])
        for i in range(1, len(pieces), 2):
            kind, body = self.markers[pieces[i]], pieces[i + 1]
            pos += len(pieces[i])
            own = None
            if kind == "span":
                try:
                    own, body = split_settings(body, self.args.span_settings_marker)
                except ValueError as e:
                    raise ValueError(f"at character {pos}: {e}") from None
            out.append((kind, body, own))
            pos += len(pieces[i + 1])
        return pieces[0], out

    def encode_all(self, texts: list[str]) -> dict[tuple[str, bool], tuple[int, ...]]:
        """(segment text, is prefix) -> ids for every segment of `texts`: the memo's misses are encoded in one batch
        call per kind, which the Rust tokenizer spreads over its threads (one encode call per segment cost ~0.2 ms
        of Python each, most of a 600-prompt RAG batch's tokenizing)."""
        pieces: set[tuple[str, bool]] = set()
        for text in texts:
            try:
                prefix, parts = self._parts(text)
            except ValueError:
                continue  # refused when its request is built, which names the request
            pieces.add((prefix, True))
            pieces.update((body, False) for _, body, _ in parts if body)
        known = {key: ids for key in pieces if (ids := self._tokens.get(*key)) is not None}
        for first in (True, False):
            batch = [text for text, is_prefix in pieces if is_prefix == first and (text, first) not in known]
            if batch:
                encoded = self.tokenizer(batch, add_special_tokens=first)["input_ids"]
                for text, ids in zip(batch, encoded):
                    known[(text, first)] = self._tokens.put(text, first, tuple(ids))
        return known

    def from_ids(self, ids: list[int]) -> list[Segment]:
        """Cut `ids` at the marker ids; every other id must be in the vocabulary (the first one outside is named)."""
        cuts = self._marker_positions(ids)
        bounds = [-1, *cuts, len(ids)]
        pieces = [ids[lo + 1 : hi] for lo, hi in pairwise(bounds)]
        for piece in pieces:
            if piece and (min(piece) < 0 or max(piece) >= self.vocab_size):
                tok = next(t for t in piece if not 0 <= t < self.vocab_size)
                raise ValueError(f"input_ids holds token id {tok}, outside the vocabulary [0, {self.vocab_size})")
        kinds = ["prefix", *(self.marker_ids[ids[i]] for i in cuts)]
        segments = [Segment(kind, tuple(piece)) for kind, piece in zip(kinds, pieces)]
        for i, seg in enumerate(segments):
            if seg.kind == "span" and not seg.token_ids:
                raise ValueError(f"empty span: span marker #{i} in input_ids is followed by no tokens")
        return self._finish(segments)

    def _finish(self, segments: list[Segment]) -> list[Segment]:
        if self.args.disable_pic:
            flat = tuple(chain.from_iterable(s.token_ids for s in segments))
            segments = [Segment("prefix", flat)]
        if not any(s.token_ids for s in segments):
            raise ValueError("the prompt is empty")
        return segments

    def _marker_positions(self, ids: list[int]) -> list[int]:
        """Indices of the marker ids, found by C-level scans (list.index) instead of a Python step per token."""
        found = []
        for marker in self.marker_ids:
            i = -1
            while True:
                try:
                    i = ids.index(marker, i + 1)
                except ValueError:
                    break
                found.append(i)
        return sorted(found)

    def _encode(self, text: str, first: bool, known: dict | None = None) -> tuple[int, ...]:
        if not text and not first:
            return ()
        ids = known.get((text, first)) if known else None
        return ids if ids is not None else self._tokens(text, first)

    def _tokenize(self, text: str, first: bool) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=first))


def _opening(marker: str) -> str:
    """A marker without its closing punctuation (`<|ssep` of `<|ssep|>`): text starting with it means a marker."""
    return re.sub(r"[^\w]+$", "", marker)
