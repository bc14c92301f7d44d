"""SGLang's radix prefix cache over KV slots, split into namespaces.

Every key carries an `extra_key`; each distinct extra_key has its own root, so keys of different namespaces never
match each other even when their tokens agree. That one mechanism is what lets span KV, prompt-dependent KV and
plain causal KV share a single tree and a single LRU without ever aliasing (see segments.py for the keys,
radix_tree.py for the nodes).

Ownership contract with the caller:
  * `match_prefix` hands out slots the tree owns; the caller locks `last_node` (`inc_lock_ref`) for as long as it
    reads them and unlocks it (`dec_lock_ref`) afterwards. Unlocked slots may be evicted at any time.
  * `insert(key, value)` stores only the page-aligned head of the key. It returns `n`, the number of leading
    tokens that were already in the tree: value[:n] stays with the caller (who frees the part it allocated
    itself), value[n:aligned] now belongs to the tree, and value[aligned:] (the unaligned tail) stays with the
    caller. Disabled cache: `insert` takes nothing and returns 0, so the caller frees all of `value` itself.
  * The tree frees slots only in `evict`, through `allocator.free`; `reset` forgets everything without freeing
    (the caller clears the allocator alongside it). It frees them from a host copy of each node's slots taken when
    the node got them, so eviction never waits for kernels queued on the device.

Hierarchical cache (`host_pool` given): `evict` moves a node's KV to host memory instead of dropping it; the node
stays in the tree with `host_value` set and no device slots, and `match_prefix` copies it back into fresh device
slots when a key walks through it. Only when the host pool is full too are its least recently used host leaves
dropped. Every node a match returns, and so every node anyone locks, is on the device; sizes count device tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.mem_cache.host_pool import HostKVPool
from sglang_pic.radix_ext.lru_heap import LruHeap
from sglang_pic.radix_ext.radix_tree import EMPTY_SLOTS, MatchResult, RadixKey, TreeNode, common_prefix_len
from sglang_pic.utils_tensor import HostCopy, copy_to_host, to_device


class RadixCache:
    def __init__(
        self,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        disable: bool = False,
        host_pool: HostKVPool | None = None,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.host_pool = None if disable else host_pool
        self._empty = torch.empty(0, dtype=torch.int64, device=token_to_kv_pool_allocator.device)
        self._clock = itertools.count(1)
        self.backed_up_tokens = 0  # tokens moved to the host pool, over the tree's life
        self.loaded_tokens = 0  # tokens brought back from it
        self.reset()

    def reset(self) -> None:
        """Forget every node. Slots are not freed: the caller clears the allocator at the same time."""
        self.roots: dict[str | None, TreeNode] = {}
        self._device_lru = LruHeap(self._is_device_leaf, self._nodes, self._max_heap_entries)
        self._host_lru = LruHeap(self._is_host_leaf, self._nodes, self._max_heap_entries)
        self._num_nodes = 0
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.host_size_ = 0
        if self.host_pool is not None:
            self.host_pool.clear()

    # ---- lookup ---------------------------------------------------------------------------------------------
    def _child_key(self, tokens: tuple[int, ...], start: int) -> int | tuple[int, ...]:
        return tokens[start] if self.page_size == 1 else tokens[start : start + self.page_size]

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of `key` in its namespace.

        Splits the last node when the match ends inside it, so `last_node` covers exactly the matched tokens and
        locking it protects nothing more. Refreshes the LRU time of every node on the path.
        """
        root = self.roots.get(key.extra_key)
        if self.disable or root is None:
            return MatchResult(self._empty, root if root is not None else TreeNode(namespace=key.extra_key))
        n = self._aligned(len(key.token_ids))
        tokens = key.token_ids[:n]
        now = next(self._clock)
        node, i, values = root, 0, []
        while i < n:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            child.last_access_time = now
            matched = common_prefix_len(child.key, tokens, i, self.page_size)
            if matched < len(child.key):
                child = self._split(child, matched)
            if not child.on_device and not self._load(child):
                break
            values.append(child.value)
            node, i = child, i + matched
        device_indices = torch.cat(values) if values else self._empty
        return MatchResult(device_indices, node)

    def _load(self, node: TreeNode) -> bool:
        """Copy a host-resident node back into fresh device slots; False when the device has no room for it."""
        n = len(node.key)
        allocator = self.token_to_kv_pool_allocator
        # The matched path above must stay on the device, and the node's own backup in the host pool.
        self.inc_lock_ref(node.parent)
        node.lock_ref += 1
        try:
            short = n - allocator.available_size()
            if short > 0:
                self.evict(short)
            host_slots = allocator.alloc_host(n)
        finally:
            node.lock_ref -= 1
            self.dec_lock_ref(node.parent)
        if host_slots is None:
            return False
        slots = to_device(host_slots, allocator.device)
        self.host_pool.restore(node.host_value, slots)
        node.value, node.value_cpu, node.host_value = slots, HostCopy(host_slots), None
        self._offer(node)
        self.host_size_ -= n
        self.evictable_size_ += n
        self.loaded_tokens += n
        return True

    # ---- update ---------------------------------------------------------------------------------------------
    def insert(self, key: RadixKey, value: torch.Tensor) -> int:
        """Store key's page-aligned head; returns how many leading tokens the tree already had (see module doc)."""
        if value.numel() != len(key.token_ids):
            raise ValueError(f"insert: key has {len(key.token_ids)} tokens but value has {value.numel()} slots")
        n = self._aligned(len(key.token_ids))
        if self.disable or n == 0:
            return 0
        tokens = key.token_ids[:n]
        root = self.roots.get(key.extra_key)
        if root is None:
            root = self.roots[key.extra_key] = TreeNode(namespace=key.extra_key)
        now = next(self._clock)
        node, i = root, 0
        while i < n:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            child.last_access_time = now
            matched = common_prefix_len(child.key, tokens, i, self.page_size)
            if matched < len(child.key):
                child = self._split(child, matched)
            node, i = child, i + matched
        if i < n:
            slots = value[i:n].to(torch.int64).clone()
            leaf = TreeNode(key=tokens[i:], value=slots, value_cpu=copy_to_host(slots)[0], parent=node,
                            last_access_time=now)
            node.children[self._child_key(tokens, i)] = leaf
            self._num_nodes += 1
            self.evictable_size_ += n - i
            self._offer(leaf)
        return i

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; the new upper part inherits the lock count, so every lock stays balanced."""
        parent = node.parent
        upper = TreeNode(
            key=node.key[:at],
            value=node.value[:at],
            value_cpu=node.value_cpu[:at],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access_time=node.last_access_time,
            host_value=None if node.on_device else node.host_value[:at],
        )
        parent.children[self._child_key(node.key, 0)] = upper
        self._num_nodes += 1
        node.key, node.value, node.value_cpu, node.parent = node.key[at:], node.value[at:], node.value_cpu[at:], upper
        if not node.on_device:
            node.host_value = node.host_value[at:]
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # ---- eviction ---------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free the device slots of LRU unlocked leaves, across all namespaces, until `num_tokens` are freed;
        returns tokens freed. With a host pool a leaf's KV moves there and the node stays; else it is dropped.

        Candidates come from a heap kept between calls (radix_ext.lru_heap), so a call costs O(log n) per node it
        releases rather than a walk of the whole tree; the order is the same LRU order a walk would give."""
        if self.disable or num_tokens <= 0:
            return 0
        released = 0
        while released < num_tokens and self.evictable_size_ > 0:
            node = self._device_lru.pop()
            if node is None:
                break
            parent = node.parent
            released += len(node.key)
            self.evictable_size_ -= len(node.key)
            if not self._backup(node):
                self._drop(node)
            if parent.is_root:
                if not parent.children:
                    self._drop_root(parent)
            else:
                self._offer(parent)
        return released

    def _max_heap_entries(self) -> int:
        return 2 * self._num_nodes + 64

    def _offer(self, node: TreeNode) -> None:
        """Push `node` as an eviction candidate of the tier it now qualifies for, if any."""
        self._device_lru.offer(node)
        if self.host_pool is not None:
            self._host_lru.offer(node)

    def _backup(self, leaf: TreeNode) -> bool:
        """Move a device leaf's KV to the host pool, dropping LRU host leaves for room; False if it cannot."""
        if self.host_pool is None:
            return False
        n = len(leaf.key)
        if self.host_pool.available_size() < n:
            self._evict_host(n - self.host_pool.available_size())
        host = self.host_pool.backup(leaf.value)
        if host is None:
            return False
        self.token_to_kv_pool_allocator.free(leaf.value_cpu.get())
        leaf.value, leaf.value_cpu, leaf.host_value = self._empty, HostCopy(EMPTY_SLOTS), host
        self.host_size_ += n
        self.backed_up_tokens += n
        self._offer(leaf)
        return True

    def _evict_host(self, num_tokens: int) -> None:
        """Drop LRU host-resident leaves (never one being loaded) until `num_tokens` host slots are free."""
        released = 0
        while released < num_tokens and self.host_size_ > 0:
            node = self._host_lru.pop()
            if node is None:
                break
            parent = node.parent
            released += len(node.key)
            self._drop(node)
            if not parent.is_root:
                self._offer(parent)

    def _drop(self, node: TreeNode) -> None:
        """Detach `node` and free what it and its (host-resident) descendants hold."""
        del node.parent.children[self._child_key(node.key, 0)]
        node.parent = None
        stack = [node]
        while stack:
            n = stack.pop()
            self._num_nodes -= 1
            if n.on_device:
                self.token_to_kv_pool_allocator.free(n.value_cpu.get())
            else:
                self.host_pool.free(n.host_value)
                self.host_size_ -= len(n.key)
            stack.extend(n.children.values())

    @staticmethod
    def _has_device_child(node: TreeNode) -> bool:
        return any(c.on_device for c in node.children.values())

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """A device node nobody locks whose children, if any, are all on the host: what `evict` may take."""
        return node.on_device and node.lock_ref == 0 and not self._has_device_child(node)

    @staticmethod
    def _is_host_leaf(node: TreeNode) -> bool:
        """A host-resident leaf nobody locks (a node being loaded is locked): what `_evict_host` may drop."""
        return not node.on_device and not node.children and node.lock_ref == 0

    def _drop_root(self, root: TreeNode) -> None:
        if self.roots.get(root.namespace) is root:
            del self.roots[root.namespace]

    # ---- locking ----------------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect node and its ancestors from eviction; returns the change in evictable size (<= 0)."""
        if self.disable:
            return 0
        delta = 0
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref on the same node; returns the change in evictable size (>= 0)."""
        if self.disable:
            return 0
        delta = 0
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
                self._offer(node)
            node = node.parent
        return delta

    # ---- accounting -------------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def host_size(self) -> int:
        """Tokens whose KV the tree keeps in the host pool."""
        return self.host_size_

    def total_size(self) -> int:
        """Device tokens held by the tree, counted by walking it (a check on evictable_size + protected_size)."""
        return sum(len(n.key) for n in self._nodes() if n.on_device)

    def all_slots(self) -> torch.Tensor:
        """Every device slot the tree owns."""
        values = [n.value for n in self._nodes() if n.on_device]
        return torch.cat(values) if values else self._empty

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node of every namespace."""
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pretty_print(self) -> str:
        """The tree as indented text (also printed), for debugging."""
        lines = []
        for extra_key, root in self.roots.items():
            lines.append(f"[{extra_key!r}]")
            stack = [(c, 1) for c in root.children.values()]
            while stack:
                node, depth = stack.pop()
                head = list(node.key[:8]) + (["..."] if len(node.key) > 8 else [])
                where = "" if node.on_device else " host"
                lines.append(
                    f"{'  ' * depth}{len(node.key)} {head} lock={node.lock_ref} t={node.last_access_time}{where}"
                )
                stack.extend((c, depth + 1) for c in node.children.values())
        lines.append(f"evictable={self.evictable_size_} protected={self.protected_size_} host={self.host_size_}")
        text = "\n".join(lines)
        print(text)
        return text
