"""Radix keys for a marker-aware prompt, chosen so a cache hit always equals recomputation.

A prompt is an optional prefix, then spans and PDEP (prompt-dependent) segments. The KV of each kind depends on:
  prefix  its own tokens only (causal)          -> namespace None, shared with plain prompts
  span    its own tokens                        -> namespace "span", shared whatever precedes it
  pdep    the whole marker-aware prompt before  -> namespace "pdep:<sha256 of that structure>"
so each segment is keyed by exactly what its KV depends on. Generated tokens are cached under `tail_key`.

A span may carry the quality settings a request chose for it (span_policy.py): an `anchor`, tokens it was
prefilled behind (its KV then comes from a span job, never from a request's own row), and `head`, how many of
its first tokens the request recomputes with full attention, which are exact for the structure before them and
so keyed like PDEP text there. A span behind an anchor attends causally to the anchor and itself: that is the KV
of the plain text anchor + span, so it is keyed as that prefix (namespace None), and a plain prompt starting
with the same text shares it. Both settings are part of the structure later PDEP keys hash, since the KV after
a span depends on them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sglang_pic.radix_ext.radix_tree import RadixKey

SegmentKind = Literal["prefix", "span", "pdep"]
SPAN_NAMESPACE = "span"
PDEP_NAMESPACE_PREFIX = "pdep:"
_KINDS = ("prefix", "span", "pdep")
_HASH_TAG = b"sglang_pic.segments.v2\0"


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    anchor: tuple[int, ...] = ()  # spans only: the tokens the span is prefilled behind
    head: int = 0  # spans only: leading tokens each request recomputes with full attention

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown segment kind {self.kind!r}; expected one of {_KINDS}")
        if self.kind != "span" and (self.anchor or self.head):
            raise ValueError(f"a {self.kind} segment has no anchor or head; only spans do")
        if self.head < 0:
            raise ValueError(f"a span's head must be >= 0, got {self.head}")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "anchor", tuple(self.anchor))

    @property
    def from_job(self) -> bool:
        """Whether a span's KV can only come from a span job: an anchor is not in any request's row, and the
        shared tail after a recomputed head was computed behind the span's own head, not the request's."""
        return bool(self.anchor) or self.head > 0


def canonicalize(segments: Sequence[Segment]) -> list[Segment]:
    """Rewrite segments into their one canonical form: [prefix] (span [pdep])*, with no empty segment.

    PDEP text with no span before it sees only causal text, so its KV is plain prefix KV: it joins the prefix.
    Adjacent PDEP segments attend exactly like one, and an empty prefix or PDEP carries nothing. A span whose head
    covers it is recomputed whole with full attention: it is PDEP text. A prompt that ends in a span from a job
    ends in PDEP text one token long, since the request computes its last token itself (its logits give the first
    output token) and cannot do so behind the span's anchor. Equal prompts thus get equal keys however their
    markers were written.
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
        if seg.kind == "span" and seg.head >= len(seg.token_ids):
            seg = Segment("pdep", seg.token_ids)
        if seg.kind == "span":
            out.append(seg)
        elif not out:
            out.append(Segment("prefix", seg.token_ids))
        elif out[-1].kind != "span":
            out[-1] = Segment(out[-1].kind, out[-1].token_ids + seg.token_ids)
        else:
            out.append(seg)
    return out


def _last_token_own(segments: Sequence[Segment]) -> list[Segment]:
    """`segments` with a trailing span from a job cut before its last token, which becomes PDEP text."""
    out = list(segments)
    last = max((i for i, s in enumerate(out) if s.token_ids), default=None)
    if last is not None and out[last].kind == "span" and out[last].from_job:
        seg = out[last]
        rest = [Segment("span", seg.token_ids[:-1], seg.anchor, seg.head)] if len(seg.token_ids) > 1 else []
        out[last : last + 1] = [*rest, Segment("pdep", seg.token_ids[-1:])]
    return out


def _check_canonical(segments: Sequence[Segment]) -> None:
    for i, seg in enumerate(segments):
        prev = segments[i - 1].kind if i else None
        ok = bool(seg.token_ids) and (
            (seg.kind == "prefix" and i == 0)
            or (seg.kind == "span" and seg.head < len(seg.token_ids))
            or (seg.kind == "pdep" and prev == "span")
        )
        if not ok:
            raise ValueError(f"segment {i} ({seg.kind}) is not in canonical form; call canonicalize() first")


def _encode(seg: Segment) -> bytes:
    """Kind, length, tokens, then anchor length, anchor and head, as little-endian int64: self-delimiting, so a
    sequence of records is unambiguous."""
    n, m = len(seg.token_ids), len(seg.anchor)
    return struct.pack(f"<BQ{n}qQ{m}qQ", _KINDS.index(seg.kind), n, *seg.token_ids, m, *seg.anchor, seg.head)


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
