"""RadixCache: unit cases, then a stateful property test driving it like the scheduler, against a brute-force model."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.radix_ext.radix_tree import MatchResult, RadixKey, TreeNode
from sglang_pic.radix_ext.radix_tree import common_prefix_len


def make(page_size: int, pages: int = 64, disable: bool = False) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    allocator = TokenToKVPoolAllocator(pages * page_size, page_size, "cpu")
    return allocator, RadixCache(allocator, page_size, disable=disable)


def put(allocator: TokenToKVPoolAllocator, tree: RadixCache, key: RadixKey) -> torch.Tensor:
    """Allocate slots for key, insert it, free what the tree did not take; returns the tree's slots for the key."""
    slots = allocator.alloc(len(key))
    already = tree.insert(key, slots)
    aligned = len(key) - len(key) % tree.page_size
    allocator.free(slots[:already])
    allocator.free(slots[aligned:])
    return tree.match_prefix(key).device_indices


def check_sizes(tree: RadixCache) -> None:
    assert tree.evictable_size() + tree.protected_size() == tree.total_size() == tree.all_slots().numel()


# ---- unit cases ---------------------------------------------------------------------------------------------------
def test_empty_tree_matches_nothing():
    _, tree = make(1)
    result = tree.match_prefix(RadixKey((1, 2, 3)))
    assert result.device_indices.numel() == 0
    assert tree.inc_lock_ref(result.last_node) == 0 and tree.dec_lock_ref(result.last_node) == 0


def test_insert_match_and_split_page1():
    allocator, tree = make(1)
    slots = put(allocator, tree, RadixKey((1, 2, 3, 4, 5)))
    result = tree.match_prefix(RadixKey((1, 2, 3, 9)))
    assert result.device_indices.tolist() == slots[:3].tolist()
    assert result.last_node.key == (1, 2, 3) and len(next(iter(result.last_node.children.values())).key) == 2
    assert tree.match_prefix(RadixKey((1, 2, 3, 4, 5, 6))).device_indices.tolist() == slots.tolist()
    check_sizes(tree)


def test_insert_returns_already_cached_count_and_takes_the_rest():
    allocator, tree = make(1)
    first = put(allocator, tree, RadixKey((1, 2, 3)))
    slots = allocator.alloc(5)
    already = tree.insert(RadixKey((1, 2, 3, 7, 8)), slots)
    assert already == 3
    allocator.free(slots[:already])
    got = tree.match_prefix(RadixKey((1, 2, 3, 7, 8))).device_indices
    assert got.tolist() == first.tolist() + slots[3:].tolist()
    assert tree.insert(RadixKey((1, 2, 3, 7, 8)), got) == 5
    assert tree.total_size() == 5


def test_page_size_4_aligns_inserts_and_matches():
    allocator, tree = make(4)
    slots = allocator.alloc(10)
    assert tree.insert(RadixKey(tuple(range(10))), slots) == 0
    allocator.free(slots[8:])
    assert tree.total_size() == 8
    assert tree.match_prefix(RadixKey(tuple(range(7)))).device_indices.tolist() == slots[:4].tolist()
    # A mismatch inside the second page matches only the first page and splits on the page boundary.
    result = tree.match_prefix(RadixKey((0, 1, 2, 3, 4, 5, 9, 7)))
    assert result.device_indices.tolist() == slots[:4].tolist() and result.last_node.key == (0, 1, 2, 3)
    assert tree.match_prefix(RadixKey((0, 1, 2))).device_indices.numel() == 0
    check_sizes(tree)


def test_page_children_are_keyed_by_whole_first_page():
    allocator, tree = make(4)
    a = put(allocator, tree, RadixKey((1, 2, 3, 4)))
    b = put(allocator, tree, RadixKey((1, 2, 3, 5)))
    assert tree.match_prefix(RadixKey((1, 2, 3, 4))).device_indices.tolist() == a.tolist()
    assert tree.match_prefix(RadixKey((1, 2, 3, 5))).device_indices.tolist() == b.tolist()
    assert not set(a.tolist()) & set(b.tolist())


def test_namespaces_never_match_each_other_and_empty_roots_are_dropped():
    allocator, tree = make(1)
    plain = put(allocator, tree, RadixKey((1, 2, 3)))
    span = put(allocator, tree, RadixKey((1, 2, 3), "span"))
    assert not set(plain.tolist()) & set(span.tolist())
    assert tree.match_prefix(RadixKey((1, 2, 3), "span")).device_indices.tolist() == span.tolist()
    assert tree.match_prefix(RadixKey((1, 2, 3), "pdep:x")).device_indices.numel() == 0
    assert tree.evict(100) == 6
    assert tree.roots == {} and allocator.available_size() == allocator.size


def test_evict_is_lru_and_frees_through_the_allocator():
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 1)))
    put(allocator, tree, RadixKey((2, 2)))
    tree.match_prefix(RadixKey((1, 1)))
    before = allocator.available_size()
    assert tree.evict(1) == 2
    assert allocator.available_size() == before + 2
    assert tree.match_prefix(RadixKey((2, 2))).device_indices.numel() == 0
    assert tree.match_prefix(RadixKey((1, 1))).device_indices.numel() == 2


def test_evict_climbs_to_parents_that_become_leaves():
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 2, 3)))
    put(allocator, tree, RadixKey((1, 2, 4)))
    assert tree.evict(3) == 4
    assert tree.total_size() == 0 and allocator.available_size() == allocator.size


def test_locked_path_survives_eviction_and_sizes_move():
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 2, 3)))
    put(allocator, tree, RadixKey((5, 6)))
    result = tree.match_prefix(RadixKey((1, 2)))
    assert tree.inc_lock_ref(result.last_node) == -2
    assert (tree.protected_size(), tree.evictable_size()) == (2, 3)
    assert tree.evict(100) == 3
    assert tree.match_prefix(RadixKey((1, 2, 3))).device_indices.tolist() == result.device_indices.tolist()
    assert tree.dec_lock_ref(result.last_node) == 2
    assert (tree.protected_size(), tree.evictable_size()) == (0, 2)
    check_sizes(tree)


def test_splitting_a_locked_node_keeps_lock_counts():
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 2, 3, 4, 5, 6)))
    locked = tree.match_prefix(RadixKey((1, 2, 3, 4, 5, 6))).last_node
    tree.inc_lock_ref(locked)
    tree.match_prefix(RadixKey((1, 2, 3, 9)))  # splits the locked node
    assert locked.parent.lock_ref == 1 and locked.lock_ref == 1
    assert tree.protected_size() == 6 and tree.evict(100) == 0
    tree.dec_lock_ref(locked)
    assert tree.evictable_size() == 6 and tree.protected_size() == 0
    assert tree.evict(100) == 6


def test_unbalanced_unlock_raises():
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 2)))
    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(tree.match_prefix(RadixKey((1, 2))).last_node)


def test_insert_rejects_length_mismatch():
    _, tree = make(1)
    with pytest.raises(ValueError):
        tree.insert(RadixKey((1, 2)), torch.tensor([3]))


def test_disabled_cache_stores_nothing():
    allocator, tree = make(1, disable=True)
    slots = allocator.alloc(3)
    assert tree.insert(RadixKey((1, 2, 3)), slots) == 0
    assert tree.match_prefix(RadixKey((1, 2, 3))).device_indices.numel() == 0
    assert tree.total_size() == 0 and tree.all_slots().numel() == 0 and tree.evict(10) == 0


def test_reset_forgets_everything():
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 2), "span"))
    tree.reset()
    assert tree.total_size() == 0 and tree.evictable_size() == 0 and tree.roots == {}


def test_pretty_print_lists_namespaces(capsys):
    allocator, tree = make(1)
    put(allocator, tree, RadixKey((1, 2), "span"))
    text = tree.pretty_print()
    assert "'span'" in text and text in capsys.readouterr().out


def test_long_keys_are_handled_without_quadratic_work():
    allocator, tree = make(1, pages=40_000)
    key = tuple(range(30_000))
    put(allocator, tree, RadixKey(key))
    other = key[:20_000] + (-1,) + key[20_001:]
    assert tree.match_prefix(RadixKey(other)).device_indices.numel() == 20_000


@given(
    st.lists(st.integers(0, 2), max_size=300),
    st.lists(st.integers(0, 2), max_size=300),
    st.integers(0, 5),
    st.sampled_from([1, 2, 4]),
)
def test_common_prefix_len_matches_brute_force(edge, tokens, start, page_size):
    start = min(start, len(tokens))
    expected = 0
    while expected < min(len(edge), len(tokens) - start) and edge[expected] == tokens[start + expected]:
        expected += 1
    got = common_prefix_len(tuple(edge), tuple(tokens), start, page_size)
    assert got == expected - expected % page_size


# ---- stateful property test against a brute-force model ------------------------------------------------------------
NAMESPACES = (None, "span", "pdep:a")
SHARED = ((), (0, 1, 2, 0, 1, 2, 0, 1), (2, 2, 1, 1, 0, 0), (0, 1, 2, 0, 1, 2, 1, 1, 1, 2))
keys = st.builds(
    lambda ns, head, tail: RadixKey(head + tuple(tail), ns),
    st.sampled_from(NAMESPACES),
    st.sampled_from(SHARED),
    st.lists(st.integers(0, 2), max_size=8),
).filter(lambda k: len(k) > 0)


@dataclass
class Running:
    """A simulated request: tree slots for key[:cached] (locked via lock_node), its own slots for the rest."""

    key: RadixKey
    slots: torch.Tensor
    cached: int
    lock_node: TreeNode


class RadixMachine(RuleBasedStateMachine):
    """Admits, checkpoints, finishes and aborts requests the way ReqKVManager does, checking every step."""

    @initialize(page_size=st.sampled_from([1, 4]), pages=st.integers(6, 16))
    def setup(self, page_size: int, pages: int) -> None:
        self.ps = page_size
        self.allocator, self.tree = make(page_size, pages)
        self.model: dict[tuple, list[int]] = {}  # (namespace, key prefix ending on a page end) -> its last page
        self.running: list[Running] = []

    # ---- model -----------------------------------------------------------------------------------------------------
    def expected_match(self, key: RadixKey) -> list[int]:
        out: list[int] = []
        for end in range(self.ps, len(key) + 1, self.ps):
            page = self.model.get((key.extra_key, key.token_ids[:end]))
            if page is None:
                break
            out.extend(page)
        return out

    def match(self, key: RadixKey) -> MatchResult:
        result = self.tree.match_prefix(key)
        assert result.device_indices.tolist() == self.expected_match(key), "false or missed hit"
        return result

    def record(self, key: RadixKey, slots: torch.Tensor, lo: int, hi: int) -> None:
        for end in range(lo + self.ps, hi + 1, self.ps):
            self.model[(key.extra_key, key.token_ids[:end])] = slots[end - self.ps : end].tolist()

    def lru_walk(self, num_tokens: int) -> set[int]:
        """Ids of the nodes a walk of the whole tree picks for `num_tokens`: least recently used unlocked leaves
        first, a parent joining once its children are gone (the order evict's heap must reproduce)."""
        by_id = {n.id: n for n in self.tree._nodes()}
        gone: set[int] = set()

        def leaf(n: TreeNode) -> bool:
            return n.lock_ref == 0 and all(c.id in gone for c in n.children.values())

        heap = [(n.last_access_time, n.id) for n in by_id.values() if leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = by_id[heapq.heappop(heap)[1]]
            gone.add(node.id)
            freed += len(node.key)
            if not node.parent.is_root and leaf(node.parent):
                heapq.heappush(heap, (node.parent.last_access_time, node.parent.id))
        return gone

    def evict_and_check(self, num_tokens: int) -> None:
        expected = self.lru_walk(num_tokens)
        before = {n.id for n in self.tree._nodes()}
        freed = self.tree.evict(num_tokens)
        assert before - {n.id for n in self.tree._nodes()} == expected, "eviction left LRU order"
        kept = set(self.tree.all_slots().tolist())
        gone = {k for k, page in self.model.items() if page[0] not in kept}
        assert len(gone) * self.ps == freed
        assert freed >= num_tokens or self.tree.evictable_size() == 0
        for k in gone:
            del self.model[k]
        for ns, prefix in self.model:
            parent = prefix[: -self.ps]
            assert not parent or (ns, parent) in self.model, "evicted a node but kept its child"

    # ---- rules -----------------------------------------------------------------------------------------------------
    @rule(key=keys)
    def admit(self, key: RadixKey) -> None:
        result = self.match(key)
        cached = result.device_indices.numel()
        self.tree.inc_lock_ref(result.last_node)
        need = len(key) - cached
        if self.allocator.available_size() < need:
            self.evict_and_check(need - self.allocator.available_size())
        own = self.allocator.alloc(need)
        if own is None:
            self.tree.dec_lock_ref(result.last_node)
            return
        slots = torch.cat([result.device_indices, own])
        self.running.append(Running(key, slots, cached, result.last_node))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def checkpoint(self, pick: int) -> None:
        """Hand the page-aligned part to the tree and keep running on it, like ReqKVManager.cache."""
        req = self.running[pick % len(self.running)]
        aligned = len(req.key) - len(req.key) % self.ps
        if aligned <= req.cached:
            return
        head = RadixKey(req.key.token_ids[:aligned], req.key.extra_key)
        already = self.tree.insert(head, req.slots[:aligned].clone())
        assert already >= req.cached
        self.allocator.free(req.slots[req.cached : already])
        self.record(req.key, req.slots, already, aligned)
        result = self.match(head)
        assert result.device_indices.numel() == aligned
        self.tree.inc_lock_ref(result.last_node)
        self.tree.dec_lock_ref(req.lock_node)
        req.slots[:aligned] = result.device_indices
        req.cached, req.lock_node = aligned, result.last_node

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick: int) -> None:
        req = self.running.pop(pick % len(self.running))
        aligned = len(req.key) - len(req.key) % self.ps
        already = self.tree.insert(req.key, req.slots.clone())
        assert already >= req.cached
        self.allocator.free(req.slots[req.cached : already])
        self.allocator.free(req.slots[aligned:])
        self.record(req.key, req.slots, already, aligned)
        self.tree.dec_lock_ref(req.lock_node)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def abort(self, pick: int) -> None:
        req = self.running.pop(pick % len(self.running))
        self.allocator.free(req.slots[req.cached :])
        self.tree.dec_lock_ref(req.lock_node)

    @rule(key=keys)
    def lookup(self, key: RadixKey) -> None:
        self.match(key)

    @rule(num_tokens=st.integers(1, 40))
    def evict(self, num_tokens: int) -> None:
        self.evict_and_check(num_tokens)

    # ---- invariants --------------------------------------------------------------------------------------------------
    @invariant()
    def locked_slots_are_still_cached(self) -> None:
        for req in self.running:
            assert self.expected_match(RadixKey(req.key.token_ids[: req.cached], req.key.extra_key)) == (
                req.slots[: req.cached].tolist()
            )

    @invariant()
    def tree_equals_model(self) -> None:
        slots = self.tree.all_slots().tolist()
        assert len(slots) == len(set(slots)) and set(slots) == {s for page in self.model.values() for s in page}

    @invariant()
    def every_page_has_exactly_one_owner(self) -> None:
        free = list(self.allocator.free_pages)
        tree = {s // self.ps for s in self.tree.all_slots().tolist()}
        owned = [{s // self.ps for s in req.slots[req.cached :].tolist()} for req in self.running]
        pages = free + list(tree) + [p for o in owned for p in o]
        assert len(pages) == len(set(pages)), "a page has two owners"
        assert set(pages) == set(range(1, self.allocator.num_pages + 1)), "a page leaked"
        in_use = sum(len(o) for o in owned) * self.ps
        assert self.allocator.available_size() + self.tree.total_size() + in_use == self.allocator.size

    @invariant()
    def sizes_and_lock_counts_agree(self) -> None:
        check_sizes(self.tree)
        protected = 0
        for ns, root in self.tree.roots.items():
            assert root.children, "an empty root was kept"
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, path = stack.pop()
                path = path + node.key
                holders = sum(1 for r in self.running if self.holds(r, ns, path))
                assert node.lock_ref == holders
                protected += len(node.key) if holders else 0
                stack.extend((c, path) for c in node.children.values())
        assert protected == self.tree.protected_size()

    @staticmethod
    def holds(req: Running, ns: str | None, path: tuple[int, ...]) -> bool:
        """Whether req's locked prefix runs through the node that ends `path` in namespace `ns`."""
        return req.key.extra_key == ns and req.cached >= len(path) and req.key.token_ids[: len(path)] == path

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        while self.running:
            self.abort(0)
        self.evict_and_check(10**9)
        assert self.tree.total_size() == 0 and not self.model and self.tree.roots == {}
        assert self.allocator.available_size() == self.allocator.size


RadixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRadixMachine = RadixMachine.TestCase
