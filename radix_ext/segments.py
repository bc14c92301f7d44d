"""Radix keys for a marker-aware prompt, chosen so a cache hit always equals recomputation.

A prompt is an optional prefix, then spans and PDEP (prompt-dependent) segments. The KV of each kind depends on:
  prefix  its own tokens only (causal)          -> namespace None, shared with plain prompts
  span    its own tokens                        -> namespace "span", shared whatever precedes it
  pdep    the whole marker-aware prompt before  -> namespace "pdep:<sha256 of that structure>"
so each segment is keyed by exactly what its KV depends on. Generated tokens are cached under `tail_key`.
A span adapter served apart from the weights (layers/row_lora.py) runs only prompts that keep a span, so their KV
differs from a plain prompt's even where their tokens agree: their plain keys (namespace None) move to
ADAPTER_NAMESPACE (managers/io_struct.wire_segments), and every other namespace they use only span prompts reach.

A span may carry the quality settings a request chose for it (span_policy.py): an `anchor`, tokens it was
prefilled behind (its KV then comes from a span job, never from a request's own row), and `recompute`, the runs
of its tokens the request recomputes with full attention over everything before them (a head of K tokens is the
run (0, K)). A recomputed run is exact for the structure before it, which is the structure before the span plus
the span cut at the run's start: PDEP text after that shorter span would attend exactly as the run does, so the
run is keyed as that text (recompute_namespaces). A span behind an anchor attends causally to the anchor and
itself: that is the KV of the plain text anchor + span, so it is keyed as that prefix (namespace None), and a plain
prompt starting with the same text shares it. Both settings are part of the structure later PDEP keys hash, since
the KV after a span depends on them; so are the APE factors a span is read with (`attention`), which change what
everything after it attends to but not the span's own KV.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from sglang_pic.radix_ext.radix_tree import RadixKey

SegmentKind = Literal["prefix", "span", "pdep"]
SPAN_NAMESPACE = "span"
ADAPTER_NAMESPACE = "adapter"
PDEP_NAMESPACE_PREFIX = "pdep:"
_KINDS = ("prefix", "span", "pdep")
_HASH_TAG = b"sglang_pic.segments.v4\0"
Runs = tuple[tuple[int, int], ...]  # (offset, length) runs of a segment's tokens, sorted and apart


def normalize_runs(runs: Sequence[Sequence[int]], length: int) -> Runs:
    """`runs` clipped to [0, length), sorted, with overlapping and touching runs merged and empty ones dropped."""
    out: list[list[int]] = []
    for start, n in sorted((max(int(s), 0), min(int(s) + int(n), length)) for s, n in runs):
        if n <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], n)
        else:
            out.append([start, n])
    return tuple((s, e - s) for s, e in out)


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    anchor: tuple[int, ...] = ()  # spans only: the tokens the span is prefilled behind
    # Spans only: runs of its tokens each request recomputes with full attention (normalized on construction).
    recompute: Runs = ()
    # Prefix and PDEP text only: (offset, length) runs of it that were span text, which canonicalize turned into
    # this text (a span recomputed whole, a span's last token). They attend and are keyed as this text; the runs
    # only let a request count the span tokens it computes itself. Not part of any key.
    span_runs: Runs = ()
    # Spans only: the share of its tokens the request's selection adds to `recompute` (span_policy's query_share),
    # and the pass that scores them (span_policy's select). Not part of any key: the runs it chooses are.
    query_share: float = 0.0
    select: str = "query"
    # Spans only: APE's (temperature, scale) for the attention the request's later tokens pay to the span (span_policy's
    # attention; (1, 1): plain). Not part of the span's own key (its KV is the same whatever reads it), but of the
    # structure that keys what follows it.
    attention: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown segment kind {self.kind!r}; expected one of {_KINDS}")
        if self.kind != "span" and (self.anchor or self.recompute or self.query_share or self.attention != (1, 1)):
            raise ValueError(
                f"a {self.kind} segment has no anchor, recomputed runs, query share or attention scaling; only spans do"
            )
        if self.kind == "span" and self.span_runs:
            raise ValueError("a span has no span runs; only the text that spans turn into does")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "anchor", tuple(self.anchor))
        object.__setattr__(self, "recompute", normalize_runs(self.recompute, len(self.token_ids)))
        if not self.query_share:  # a selector with nothing to select: one canonical form
            object.__setattr__(self, "select", "query")

    @property
    def from_job(self) -> bool:
        """Whether a span's KV can only come from a span job: an anchor is not in any request's row, and the
        shared tokens after a recomputed run were computed behind the span's own tokens, not the request's."""
        return bool(self.anchor) or bool(self.recompute) or self.query_share > 0

    @property
    def recomputed_whole(self) -> bool:
        return self.recompute == ((0, len(self.token_ids)),)

    def pieces(self) -> list[tuple[bool, int, int]]:
        """A span's tokens as alternating (recomputed, start, end) pieces covering it."""
        out, at = [], 0
        for start, n in self.recompute:
            if start > at:
                out.append((False, at, start))
            out.append((True, start, start + n))
            at = start + n
        if at < len(self.token_ids):
            out.append((False, at, len(self.token_ids)))
        return out


def canonicalize(segments: Sequence[Segment]) -> list[Segment]:
    """Rewrite segments into their one canonical form: [prefix] (span [pdep])*, with no empty segment.

    PDEP text with no span before it sees only causal text, so its KV is plain prefix KV: it joins the prefix.
    Adjacent PDEP segments attend exactly like one, and an empty prefix or PDEP carries nothing. A span recomputed
    whole with full attention is PDEP text. A prompt that ends in a span from a job ends in PDEP text one token
    long, since the request computes its last token itself (its logits give the first output token) and cannot do
    so behind the span's anchor. Equal prompts thus get equal keys however their markers were written.
    """
    segments = _last_token_own(segments)
    out: list[Segment] = []
    for i, seg in enumerate(segments):
        if seg.kind == "prefix" and i != 0:
            raise ValueError(f"segment {i} is a prefix; only the first segment may be one")
        if seg.kind == "span" and not seg.token_ids:
            raise ValueError(f"segment {i} is an empty span; a span needs at least one token")
        if not seg.token_ids:
            continue
        if seg.kind == "span" and seg.recomputed_whole:
            seg = Segment("pdep", seg.token_ids, span_runs=((0, len(seg.token_ids)),))
        if seg.kind == "span":
            out.append(seg)
        elif not out:
            out.append(Segment("prefix", seg.token_ids, span_runs=seg.span_runs))
        elif out[-1].kind != "span":
            prev = out[-1]
            runs = prev.span_runs + tuple((len(prev.token_ids) + o, n) for o, n in seg.span_runs)
            out[-1] = Segment(prev.kind, prev.token_ids + seg.token_ids, span_runs=runs)
        else:
            out.append(seg)
    return out


def _last_token_own(segments: Sequence[Segment]) -> list[Segment]:
    """`segments` with a trailing span from a job cut before its last token, which becomes PDEP text."""
    out = list(segments)
    last = max((i for i, s in enumerate(out) if s.token_ids), default=None)
    if last is not None and out[last].kind == "span" and out[last].from_job:
        seg = out[last]
        rest = [replace(seg, token_ids=seg.token_ids[:-1])] if len(seg.token_ids) > 1 else []
        out[last : last + 1] = [*rest, Segment("pdep", seg.token_ids[-1:], span_runs=((0, 1),))]
    return out


def _check_canonical(segments: Sequence[Segment]) -> None:
    for i, seg in enumerate(segments):
        prev = segments[i - 1].kind if i else None
        ok = bool(seg.token_ids) and (
            (seg.kind == "prefix" and i == 0)
            or (seg.kind == "span" and not seg.recomputed_whole)
            or (seg.kind == "pdep" and prev == "span")
        )
        if not ok:
            raise ValueError(f"segment {i} ({seg.kind}) is not in canonical form; call canonicalize() first")


def _token_hasher(tokens: Sequence[int]):
    return hashlib.sha256(array("q", tokens).tobytes())


def _encode(seg: Segment, length: int | None = None, tokens_digest: bytes | None = None) -> bytes:
    """Kind, length, the sha256 of the tokens (int64s), then anchor length, anchor, the number of recomputed runs and
    their (offset, length) pairs, as little-endian int64, then the APE factors as two float64: self-delimiting, so
    a sequence of records is unambiguous.
    `length` and `tokens_digest`: the record of the segment cut to its first `length` tokens, whose digest the caller
    has (a running hash over the tokens makes every cut of a span one pass: recompute_namespaces)."""
    n = len(seg.token_ids) if length is None else length
    digest = tokens_digest if tokens_digest is not None else _token_hasher(seg.token_ids).digest()
    cut = seg.recompute if length is None else normalize_runs(seg.recompute, n)  # as the cut Segment holds them
    m, r = len(seg.anchor), len(cut)
    runs = [x for run in cut for x in run]
    return struct.pack(
        f"<BQ32sQ{m}qQ{2 * r}q2d", _KINDS.index(seg.kind), n, digest, m, *seg.anchor, r, *runs, *seg.attention
    )


def _structure_hasher(segments: Sequence[Segment]):
    h = hashlib.sha256(_HASH_TAG)
    for seg in segments:
        h.update(_encode(seg))
    return h


def pdep_namespace(before: Sequence[Segment]) -> str:
    """Namespace of PDEP text that follows the canonical segments `before`."""
    return PDEP_NAMESPACE_PREFIX + _structure_hasher(before).hexdigest()


def namespaces_before(segments: Sequence[Segment]) -> list[str]:
    """For each segment of a canonical prompt, the PDEP namespace of the structure before it: what text there that
    attends to everything before it (PDEP text, a recomputed span head) is keyed on. Hashed once, incrementally."""
    _check_canonical(segments)
    h = _structure_hasher(())
    out = []
    for seg in segments:
        out.append(PDEP_NAMESPACE_PREFIX + h.hexdigest())
        h.update(_encode(seg))
    return out


def recompute_namespaces(segments: Sequence[Segment]) -> list[tuple[str, ...]]:
    """For each segment of a canonical prompt, the namespace of each of its recomputed runs: the PDEP namespace of
    the structure before the run (the structure before the segment, then the span cut at the run's start, which
    is canonical: a run starting inside a span follows tokens the span does not recompute)."""
    _check_canonical(segments)
    h = _structure_hasher(())
    out = []
    for seg in segments:
        spaces, tokens, at = [], _token_hasher(()), 0
        for start, _ in seg.recompute:
            cut = h.copy()
            if start:
                tokens.update(array("q", seg.token_ids[at:start]).tobytes())
                at = start
                cut.update(_encode(seg, start, tokens.digest()))
            spaces.append(PDEP_NAMESPACE_PREFIX + cut.hexdigest())
        out.append(tuple(spaces))
        h.update(_encode(seg))
    return out


def segment_keys(segments: Sequence[Segment]) -> list[RadixKey]:
    """One radix key per segment of a canonical prompt (see module doc). A span's key covers all its tokens, its
    head's and its anchor's too: the tree holds the span as its job computed it."""
    keys = []
    for seg, before in zip(segments, namespaces_before(segments)):
        if seg.kind == "prefix":
            keys.append(RadixKey(seg.token_ids, None))
        elif seg.kind == "span":
            namespace = None if seg.anchor else SPAN_NAMESPACE  # an anchored span is the plain text anchor + span
            keys.append(RadixKey(seg.anchor + seg.token_ids, namespace))
        else:
            keys.append(RadixKey(seg.token_ids, before))
    return keys


def tail_key(segments: Sequence[Segment], extra_tokens: Sequence[int]) -> RadixKey:
    """Key under which a request's generated tokens are cached, given its canonical prompt segments.

    Generated tokens attend to everything before them, just like PDEP text, so they are keyed as canonicalize
    would key the prompt with them appended as PDEP text: they extend a trailing prefix or PDEP segment (the key is
    that segment's tokens plus them, in its namespace), and after a trailing span they form a new PDEP segment
    keyed on the whole prompt. A follow-up prompt that repeats the output as text therefore hits this KV.
    """
    _check_canonical(segments)
    extra = tuple(extra_tokens)
    if not segments:
        return RadixKey(extra, None)
    last = segments[-1]
    if last.kind == "span":
        return RadixKey(extra, pdep_namespace(segments))
    namespace = None if last.kind == "prefix" else pdep_namespace(segments[:-1])
    return RadixKey(last.token_ids + extra, namespace)
