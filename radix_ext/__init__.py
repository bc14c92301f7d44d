"""Span-aware radix cache: SGLang's prefix tree with namespaces, and the segment keys that select them."""

from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.radix_ext.radix_tree import MatchResult, RadixKey, TreeNode
from sglang_pic.radix_ext.segments import Segment, canonicalize, pdep_namespace, segment_keys, tail_key

__all__ = [
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "Segment",
    "TreeNode",
    "canonicalize",
    "pdep_namespace",
    "segment_keys",
    "tail_key",
]
