"""Eviction candidates of one memory tier of the radix tree (device or host), least recently used first.

Kept between evictions, so an eviction costs O(log n) per node it takes instead of a walk of the whole tree. A node
is pushed whenever it may have become a candidate; entries that went stale (the node was touched, locked, given a
child, moved to the other tier, or dropped) are checked when popped, and a touched node is pushed again with its new
access time. So the order is the one a walk of the tree would give, as long as every node is offered when it turns
into a candidate.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_pic.radix_ext.radix_tree import TreeNode


class LruHeap:
    def __init__(
        self,
        is_candidate: Callable[[TreeNode], bool],
        nodes: Callable[[], Iterable[TreeNode]],
        max_entries: Callable[[], int],
    ) -> None:
        """`nodes` walks the tree (for rebuilds); past `max_entries()` entries the heap is rebuilt, dropping the
        stale ones that pile up between evictions."""
        self.is_candidate = is_candidate
        self._nodes = nodes
        self._max_entries = max_entries
        self._entries = itertools.count()  # tie-break after (access time, node id): nodes never compare
        self._heap: list[tuple[int, int, int, TreeNode]] = []

    def offer(self, node: TreeNode) -> None:
        if not self.is_candidate(node):
            return
        heapq.heappush(self._heap, (node.last_access_time, node.id, next(self._entries), node))
        if len(self._heap) > self._max_entries():
            self.rebuild()

    def rebuild(self) -> None:
        self._heap = [(n.last_access_time, n.id, next(self._entries), n) for n in self._nodes() if self.is_candidate(n)]
        heapq.heapify(self._heap)

    def pop(self) -> TreeNode | None:
        """Take out the least recently used candidate; None when there is none. An empty heap is rebuilt once
        first: a safety net, since every candidate should already be in it."""
        for attempt in range(2):
            while self._heap:
                access, _, _, node = heapq.heappop(self._heap)
                if node.parent is None or not self.is_candidate(node):
                    continue
                if access != node.last_access_time:
                    self.offer(node)
                    continue
                return node
            if attempt == 0:
                self.rebuild()
        return None
