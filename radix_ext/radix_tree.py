"""The radix tree's plain data: keys, nodes, match results, and the page-aligned edge comparison every walk uses.

Apart from radix_cache.py so that segments.py (which builds keys) and lru_heap.py (which orders nodes) name them
without the cache's allocator and host-pool dependencies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from sglang_pic.utils_tensor import HostCopy

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
_SCAN_CHUNK = 64  # tokens compared per slice when locating the first mismatch


@dataclass(frozen=True)
class RadixKey:
    token_ids: tuple[int, ...]
    extra_key: str | None = None

    def __post_init__(self) -> None:
        # Edges are tuples and page children are keyed by tuples: a list here would never match.
        object.__setattr__(self, "token_ids", tuple(self.token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in `value` slots. Roots have an empty key and no parent."""

    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=lambda: EMPTY_SLOTS)
    parent: TreeNode | None = None
    children: dict[int | tuple[int, ...], TreeNode] = field(default_factory=dict)  # by first token / first page
    lock_ref: int = 0
    last_access_time: int = 0
    id: int = field(default_factory=itertools.count().__next__)
    namespace: str | None = None  # the extra_key a root stands for (unused below roots)
    host_value: torch.Tensor | None = None  # host slots of a node evicted to the host pool (then `value` is empty)
    # `value` copied to host memory when the node got it, so freeing its slots never waits for the GPU's queue
    value_cpu: HostCopy = field(default_factory=lambda: HostCopy(EMPTY_SLOTS))

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.host_value is None


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 slots of the matched tokens
    last_node: TreeNode  # lock this to keep the matched slots alive


def common_prefix_len(edge: tuple[int, ...], tokens: tuple[int, ...], start: int, page_size: int) -> int:
    """Length of the common prefix of `edge` and tokens[start:], floored to whole pages.

    Compares by C-level slice equality (whole edge first, then chunks) so long keys cost no per-token Python work.
    """
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tokens[start : start + n]:
        i = n
    else:
        i = 0
        while edge[i : i + _SCAN_CHUNK] == tokens[start + i : start + i + _SCAN_CHUNK]:
            i += _SCAN_CHUNK
        while edge[i] == tokens[start + i]:
            i += 1
    return i - i % page_size
