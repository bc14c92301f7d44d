"""Radix keys for a marker-aware prompt, chosen so a cache hit always equals recomputation.

A prompt is an optional prefix, then spans and PDEP (prompt-dependent) segments. The KV of each kind depends on:
  prefix  its own tokens only (causal)          -> namespace None, shared with plain prompts
  span    its own tokens only (attends inside)  -> namespace "span", shared whatever precedes it
  pdep    the whole marker-aware prompt before  -> namespace "pdep:<sha256 of that structure>"
so each segment is keyed by exactly what its KV depends on. Generated tokens are cached under `tail_key`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sglang_pic.radix_ext.radix_cache import RadixKey

SegmentKind = Literal["prefix", "span", "pdep"]
SPAN_NAMESPACE = "span"
PDEP_NAMESPACE_PREFIX = "pdep:"
_KINDS = ("prefix", "span", "pdep")
_HASH_TAG = b"sglang_pic.segments.v1\0"


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown segment kind {self.kind!r}; expected one of {_KINDS}")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))


def canonicalize(segments: Sequence[Segment]) -> list[Segment]:
    """Rewrite segments into their one canonical form: [prefix] (span [pdep])*, with no empty segment.

    PDEP text with no span before it sees only causal text, so its KV is plain prefix KV: it joins the prefix.
    Adjacent PDEP segments attend exactly like one, and an empty prefix or PDEP carries nothing. Equal prompts thus
    get equal keys however their markers were written.
    """
    out: list[Segment] = []
    for i, seg in enumerate(segments):
        if seg.kind == "prefix" and i != 0:
            raise ValueError(f"segment {i} is a prefix; only the first segment may be one")
        if seg.kind == "span" and not seg.token_ids:
            raise ValueError(f"segment {i} is an empty span; a span needs at least one token")
        if not seg.token_ids:
            continue
        if seg.kind == "span":
            out.append(seg)
        elif not out:
            out.append(Segment("prefix", seg.token_ids))
        elif out[-1].kind != "span":
            out[-1] = Segment(out[-1].kind, out[-1].token_ids + seg.token_ids)
        else:
            out.append(seg)
    return out


def _check_canonical(segments: Sequence[Segment]) -> None:
    for i, seg in enumerate(segments):
        prev = segments[i - 1].kind if i else None
        ok = bool(seg.token_ids) and (
            (seg.kind == "prefix" and i == 0) or seg.kind == "span" or (seg.kind == "pdep" and prev == "span")
        )
        if not ok:
            raise ValueError(f"segment {i} ({seg.kind}) is not in canonical form; call canonicalize() first")


def _encode(seg: Segment) -> bytes:
    """Kind, length, then tokens as little-endian int64: self-delimiting, so a sequence of records is unambiguous."""
    n = len(seg.token_ids)
    return struct.pack(f"<BQ{n}q", _KINDS.index(seg.kind), n, *seg.token_ids)


def _structure_hasher(segments: Sequence[Segment]):
    h = hashlib.sha256(_HASH_TAG)
    for seg in segments:
        h.update(_encode(seg))
    return h


def pdep_namespace(before: Sequence[Segment]) -> str:
    """Namespace of PDEP text that follows the canonical segments `before`."""
    return PDEP_NAMESPACE_PREFIX + _structure_hasher(before).hexdigest()


def segment_keys(segments: Sequence[Segment]) -> list[RadixKey]:
    """One radix key per segment of a canonical prompt (see module doc); hashes the structure once, incrementally."""
    _check_canonical(segments)
    h = _structure_hasher(())
    keys = []
    for seg in segments:
        if seg.kind == "prefix":
            keys.append(RadixKey(seg.token_ids, None))
        elif seg.kind == "span":
            keys.append(RadixKey(seg.token_ids, SPAN_NAMESPACE))
        else:
            keys.append(RadixKey(seg.token_ids, PDEP_NAMESPACE_PREFIX + h.hexdigest()))
        h.update(_encode(seg))
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
