"""Hierarchical cache: radix nodes evicted from the device KV pool wait in host memory and come back on a hit.

One file (over 400 lines): the unit cases, the property test and the engine cases share the tagged pool.

Unit cases and a stateful property test on the tree with a real one-layer KV pool whose key entries carry a tag of
the content they stand for, so a hit is checked by what the returned slots hold after any number of round trips;
then the engine, whose spans come back from the host at new offsets and give the tokens of a roomy run.
"""

from __future__ import annotations

import itertools
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.mem_cache import host_pool
from sglang_pic.mem_cache.host_pool import HostKVPool
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool
from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.radix_ext.radix_tree import RadixKey, TreeNode
from test_radix_cache import (
    check_sizes,
    keys,  # the same key space the plain tree's property test draws from
)


@dataclass
class Setup:
    allocator: TokenToKVPoolAllocator
    pool: MHATokenToKVPool
    host: HostKVPool
    tree: RadixCache


def make(page_size: int, pages: int, host_tokens: int) -> Setup:
    allocator = TokenToKVPoolAllocator(pages * page_size, page_size, "cpu")
    pool = MHATokenToKVPool(allocator.size, page_size, torch.float32, 1, 1, 2, "cpu")
    host = HostKVPool(pool, host_tokens)
    return Setup(allocator, pool, host, RadixCache(allocator, page_size, host_pool=host))


class Tags:
    """A distinct value per (namespace, prefix): what the KV of that prefix's last token stands for."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.counter = itertools.count(1)

    def of(self, key: RadixKey, n: int) -> list[float]:
        return [float(self.ids.setdefault((key.extra_key, key.token_ids[: j + 1]), next(self.counter)))
                for j in range(n)]


def write(s: Setup, slots: torch.Tensor, values: list[float]) -> None:
    """Both layers' keys and values carry the tag (the value buffers negated), so every tensor is checked."""
    t = torch.tensor(values).view(-1, 1, 1)
    for layer in range(s.pool.layer_num):
        s.pool.k_buffer[layer][slots] = t
        s.pool.v_buffer[layer][slots] = -t


def read(s: Setup, slots: torch.Tensor) -> list[float]:
    out = s.pool.k_buffer[1][slots].flatten().tolist()
    assert s.pool.v_buffer[0][slots].flatten().tolist() == [-x for x in out]
    return out


def put(s: Setup, tags: Tags, key: RadixKey) -> torch.Tensor:
    slots = s.allocator.alloc(len(key))
    write(s, slots, tags.of(key, len(key)))
    already = s.tree.insert(key, slots)
    s.allocator.free(slots[:already])
    return s.tree.match_prefix(key).device_indices


def check_accounting(s: Setup, running_slots: int = 0) -> None:
    tree = s.tree
    check_sizes(tree)
    assert s.allocator.available_size() + tree.total_size() + running_slots == s.allocator.size
    assert s.host.available_size() + tree.host_size() == s.host.size


def test_evicted_span_waits_on_the_host_and_comes_back_with_its_kv():
    s, tags = make(page_size=1, pages=8, host_tokens=16), Tags()
    doc = RadixKey((5, 6, 7, 8, 9), "span")
    first = put(s, tags, doc)
    assert s.tree.evict(5) == 5
    assert s.tree.total_size() == 0 and s.tree.host_size() == 5 and s.tree.backed_up_tokens == 5
    check_accounting(s)
    s.pool.k_buffer[1][first] = -1.0  # the device slots are free now: anything may overwrite them
    again = s.tree.match_prefix(doc)
    assert read(s, again.device_indices) == tags.of(doc, 5)
    assert s.tree.host_size() == 0 and s.tree.loaded_tokens == 5
    check_accounting(s)


class HeldCopy:
    """Stands in for the CUDA event of a backup's copies: they have landed once `done` is set (or waited for)."""

    def __init__(self) -> None:
        self.done = self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_backups_land_oldest_first_and_only_restore_waits(monkeypatch):
    """Backups return before their copies land, and land in the order they were made: a later backup into slots
    freed from an earlier one still out must not be overwritten by it. Restoring waits for what is still out."""
    copies: list[HeldCopy] = []
    monkeypatch.setattr(host_pool, "record_event", lambda device: copies.append(HeldCopy()) or copies[-1])
    s = make(page_size=1, pages=8, host_tokens=4)
    host = s.host
    host.k.zero_()
    host.v.zero_()
    slots = s.allocator.alloc(2)
    write(s, slots, [1.0, 2.0])
    first = host.backup(slots)
    assert host.k[1, first].flatten().tolist() == [0.0, 0.0]  # still on its way
    host.free(first)  # e.g. its node dropped from the host tier at once
    write(s, slots, [3.0, 4.0])
    second = host.backup(slots)
    assert sorted(second.tolist()) == sorted(first.tolist())  # the freed slots, reused
    copies[1].done = True
    host.settle()
    assert len(host.pending) == 2  # the later copy has landed but waits for the earlier one
    copies[0].done = True
    host.settle()
    assert not host.pending and host.k[1, second].flatten().tolist() == [3.0, 4.0]
    assert host.v[0, second].flatten().tolist() == [-3.0, -4.0]
    write(s, slots, [5.0, 6.0])
    third = host.backup(slots)
    assert not any(c.waited for c in copies)
    back = s.allocator.alloc(2)
    host.restore(third, back)
    assert copies[2].waited and read(s, back) == [5.0, 6.0]


def test_partial_match_splits_a_host_node_and_loads_only_the_matched_part():
    s, tags = make(page_size=2, pages=8, host_tokens=16), Tags()
    doc = RadixKey((1, 2, 3, 4, 5, 6), "span")
    put(s, tags, doc)
    s.tree.evict(6)
    shorter = RadixKey((1, 2, 3, 4, 9, 9), "span")
    hit = s.tree.match_prefix(shorter)
    assert read(s, hit.device_indices) == tags.of(doc, 4)
    assert s.tree.loaded_tokens == 4 and s.tree.host_size() == 2
    check_accounting(s)
    assert read(s, s.tree.match_prefix(doc).device_indices) == tags.of(doc, 6)


def test_full_host_pool_drops_its_least_recently_used_leaves():
    s, tags = make(page_size=1, pages=8, host_tokens=6), Tags()
    old, new = RadixKey((1, 2, 3, 4), "a"), RadixKey((5, 6, 7, 8), "b")
    put(s, tags, old)
    put(s, tags, new)
    s.tree.evict(4)  # `old` (least recent) moves to the host
    s.tree.match_prefix(new)
    s.tree.evict(4)  # `new` needs the host room `old` holds: `old` is dropped for good
    assert s.tree.match_prefix(old).device_indices.numel() == 0
    assert read(s, s.tree.match_prefix(new).device_indices) == tags.of(new, 4)
    check_accounting(s)


def host_leaves(s: Setup) -> list:
    return [n for n in s.tree._nodes() if not n.on_device and not n.children]


def present(s: Setup, key: RadixKey) -> bool:
    """Whether the whole key is in the tree, on either tier (page size 1), found without loading anything."""
    node, i = s.tree.roots.get(key.extra_key), 0
    while node is not None and i < len(key):
        node = node.children.get(key.token_ids[i])
        if node is None or node.key != key.token_ids[i : i + len(node.key)]:
            return False
        i += len(node.key)
    return node is not None


def test_host_tier_drops_in_lru_order_across_many_evictions():
    """The host heap persists between evictions: each drop must still be the least recently used host leaf a walk
    of the tree finds, after touches (inserts walking through host nodes), splits and parents turning into leaves."""
    rng = random.Random(0)
    s, tags = make(page_size=1, pages=64, host_tokens=37), Tags()  # 8 x 4 tokens + a 3-token parent of 2 x 1
    docs = [RadixKey((i, 100 + i, 200 + i, 300 + i), "span") for i in range(8)]
    docs += [RadixKey((50, 51, 52, 60 + i), "span") for i in range(2)]  # share a 3-token parent on the host
    for doc in docs:
        put(s, tags, doc)
    s.tree.evict(s.tree.evictable_size())
    assert s.tree.host_size() == s.host.size  # the host pool is full
    dropped = 0
    for step in range(12):
        for doc in rng.sample([d for d in docs if present(s, d)], 3):  # touch host nodes without loading them
            assert s.tree.insert(doc, torch.zeros(len(doc), dtype=torch.int64)) == len(doc)
        expected = min(host_leaves(s), key=lambda n: (n.last_access_time, n.id))
        fresh = RadixKey((900 + step, 1000 + step, 1100 + step, 1200 + step), "span")
        put(s, tags, fresh)
        s.tree.evict(4)  # `fresh` moves to the host, which first drops its LRU leaf
        assert expected.parent is None, f"step {step}: dropped something else than the LRU host leaf"
        dropped += 1
        docs.append(fresh)
        check_accounting(s)
    assert dropped == 12
    # Every node still on the host keeps its own KV.
    for doc in docs:
        hit = s.tree.match_prefix(doc).device_indices
        assert read(s, hit) == tags.of(doc, hit.numel())


def test_no_device_room_means_a_shorter_hit_never_a_wrong_one():
    s, tags = make(page_size=1, pages=4, host_tokens=16), Tags()
    doc = RadixKey((1, 2, 3, 4), "span")
    put(s, tags, doc)
    s.tree.evict(4)
    taken = s.allocator.alloc(3)  # a running request holds most of the device
    hit = s.tree.match_prefix(doc)
    assert hit.device_indices.numel() == 0 and s.tree.host_size() == 4
    s.allocator.free(taken)
    assert read(s, s.tree.match_prefix(doc).device_indices) == tags.of(doc, 4)


# ---- stateful property test ----------------------------------------------------------------------------------------
@dataclass(eq=False)
class Running:
    key: RadixKey
    slots: torch.Tensor
    cached: int
    lock_node: TreeNode


class HiCacheMachine(RuleBasedStateMachine):
    """Requests admitted, cached, finished and aborted as ReqKVManager does, with small device and host pools.

    Every match must return slots holding exactly the tags of the key's prefix (no false hit, nothing lost in a
    host round trip), every page-aligned prefix ever inserted must stay findable until the host pool is full, and
    the device and host pools must account for every slot.
    """

    @initialize(page_size=st.sampled_from([1, 4]), pages=st.integers(6, 12), host_pages=st.integers(2, 12))
    def setup(self, page_size: int, pages: int, host_pages: int) -> None:
        self.ps = page_size
        self.s = make(page_size, pages, host_pages * page_size)
        self.tags = Tags()
        self.running: list[Running] = []
        self.host_dropped = False

    def match(self, key: RadixKey):
        result = self.s.tree.match_prefix(key)
        n = result.device_indices.numel()
        assert n % self.ps == 0
        assert read(self.s, result.device_indices) == self.tags.of(key, n), "false hit or corrupted round trip"
        return result

    @rule(key=keys)
    def admit(self, key: RadixKey) -> None:
        result = self.match(key)
        cached = result.device_indices.numel()
        self.s.tree.inc_lock_ref(result.last_node)
        need = len(key) - cached
        if self.s.allocator.available_size() < need:
            self.s.tree.evict(need - self.s.allocator.available_size())
        own = self.s.allocator.alloc(need)
        if own is None:
            self.s.tree.dec_lock_ref(result.last_node)
            return
        write(self.s, own, self.tags.of(key, len(key))[cached:])
        self.running.append(Running(key, torch.cat([result.device_indices, own]), cached, result.last_node))

    def hand_over(self, req: Running, upto: int) -> None:
        head = RadixKey(req.key.token_ids[:upto], req.key.extra_key)
        already = self.s.tree.insert(head, req.slots[:upto].clone())
        assert already >= req.cached
        self.s.allocator.free(req.slots[req.cached : already])
        result = self.match(head)
        assert result.device_indices.numel() == upto, "the tree lost tokens it just took"
        self.s.tree.inc_lock_ref(result.last_node)
        self.s.tree.dec_lock_ref(req.lock_node)
        req.slots[:upto] = result.device_indices
        req.cached, req.lock_node = upto, result.last_node

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), finish=st.booleans())
    def cache(self, pick: int, finish: bool) -> None:
        req = self.running[pick % len(self.running)]
        aligned = len(req.key) - len(req.key) % self.ps
        if aligned > req.cached:
            self.hand_over(req, aligned)
        if finish:
            self.running.remove(req)
            self.s.allocator.free(req.slots[aligned:])
            self.s.tree.dec_lock_ref(req.lock_node)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def abort(self, pick: int) -> None:
        req = self.running.pop(pick % len(self.running))
        self.s.allocator.free(req.slots[req.cached :])
        self.s.tree.dec_lock_ref(req.lock_node)

    @rule(key=keys)
    def lookup(self, key: RadixKey) -> None:
        self.match(key)

    @rule(num_tokens=st.integers(1, 40))
    def evict(self, num_tokens: int) -> None:
        freed = self.s.tree.evict(num_tokens)
        assert freed >= num_tokens or self.s.tree.evictable_size() == 0

    @invariant()
    def pools_account_for_every_slot(self) -> None:
        if hasattr(self, "s"):
            own = sum(-(-(r.slots.numel() - r.cached) // self.ps) * self.ps for r in self.running)  # whole pages
            check_accounting(self.s, own)


HiCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_hicache_state_machine = HiCacheMachine.TestCase


# ---- engine -------------------------------------------------------------------------------------------------------
DOCS = [
    f"Report {i}: the harbour of town {i} shipped {i * 7} crates of salt, wool and dried apples to the north."
    for i in range(6)
]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_engine_brings_evicted_spans_back_from_the_host(tiny_llama):
    """A pool too small to keep every span: warmed spans are evicted, then reused behind a new prefix at a new
    offset from host memory, with the tokens of a roomy run and none of their tokens computed again."""
    prompts = [f"Question {i}, about the second report." + span(DOCS[i]) + span(DOCS[i + 3]) + "Answer:"
               for i in range(3)]
    # 4-token pages serve isolated spans (span_policy.py): the roomy run serves them so too, for the same tokens.
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, span_anchor="none",
                span_head_tokens=0) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(prompts, GREEDY)]
    small = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=160, page_size=4)
    with Engine(enable_hierarchical_cache=True, hicache_ratio=4.0, **small) as engine:
        engine.warm_spans(DOCS)
        stats = engine.get_stats()
        assert stats["hicache_host_tokens"] > 0, "the small pool should have pushed spans to the host"
        before = stats["computed_prefill_tokens"]
        outs = [engine.generate(p, GREEDY) for p in prompts]
        assert [o["output_ids"] for o in outs] == expected
        stats = engine.get_stats()
        assert stats["hicache_loaded_tokens"] > 0
        span_tokens = [len(engine.tokenizer.encode(DOCS[i], add_special_tokens=False))
                       + len(engine.tokenizer.encode(DOCS[i + 3], add_special_tokens=False)) for i in range(3)]
        for out, n in zip(outs, span_tokens):
            assert out["meta_info"]["cached_span_tokens"] >= n - 2 * 4  # whole pages of both spans reused
        computed = stats["computed_prefill_tokens"] - before
        assert computed < sum(o["meta_info"]["prompt_tokens"] for o in outs) - sum(span_tokens) + 3 * 2 * 4
    with Engine(**small) as plain:
        plain.warm_spans(DOCS)
        before = plain.get_stats()["computed_prefill_tokens"]
        assert [o["output_ids"] for o in (plain.generate(p, GREEDY) for p in prompts)] == expected
        assert plain.get_stats()["computed_prefill_tokens"] - before > computed, "without the host tier spans recompute"


def test_spans_from_jobs_come_back_from_the_host(tiny_llama):
    """Anchored spans with recomputed seams (span_policy.py, one-token pages): evicted to the host after their
    jobs, read back behind new prefixes, with the tokens of a roomy run."""
    prompts = [f"Question {i}, about the second report." + span(DOCS[i]) + span(DOCS[i + 3]) + "Answer:"
               for i in range(3)]
    settings = dict(
        model_path=str(tiny_llama), dtype="float32", span_anchor="auto", span_head_tokens=2, span_tail_tokens=2
    )
    with Engine(max_total_tokens=4096, **settings) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(prompts, GREEDY)]
    with Engine(max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=4.0, **settings) as engine:
        engine.warm_spans(DOCS)
        assert engine.get_stats()["hicache_host_tokens"] > 0, "the small pool should have pushed spans to the host"
        outs = [engine.generate(p, GREEDY) for p in prompts]
        assert [o["output_ids"] for o in outs] == expected
        assert engine.get_stats()["hicache_loaded_tokens"] > 0
        assert all(o["meta_info"]["cached_span_tokens"] > 0 and o["meta_info"]["recomputed_span_tokens"] == 8
                   for o in outs)


def test_hierarchical_cache_rejects_tensor_parallelism_and_bad_sizes(tiny_llama):
    from sglang_pic.server_args import ServerArgs

    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs(model_path=str(tiny_llama), enable_hierarchical_cache=True, tp_size=2)
    with pytest.raises(ValueError, match="hicache_ratio"):
        ServerArgs(model_path=str(tiny_llama), hicache_ratio=0)


@pytest.fixture(scope="module")
def tiny_llama_1k(tmp_path_factory: pytest.TempPathFactory):
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long"), "llama", name="llama_1k", max_position_embeddings=1024)


@pytest.mark.slow  # a long run under memory pressure
def test_isps_under_memory_pressure_reuses_spans_from_the_host(tiny_llama_1k):
    """A pool that holds the spans of only a few requests: without the host tier evicted spans are computed again
    (ISPS falls back to requests computing their own spans, like FCFS); with it, each span is computed about once
    and the tokens are those of a roomy run."""
    import random

    rng = random.Random(0)
    docs = [f"Record {i}: the village of {i} grew barley, kept {i % 7} goats and sold cheese at the river market."
            for i in range(30)]
    texts = [f"Reader {i}." + "".join(span(docs[j]) for j in rng.sample(range(30), 4)) + "Answer?" for i in range(40)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    # Isolated spans: under pressure their requests compute them (span_policy.py; spans from jobs cannot).
    common = dict(model_path=str(tiny_llama_1k), dtype="float32", schedule_policy="isps", max_running_requests=8,
                  span_anchor="none", span_head_tokens=0)
    with Engine(max_total_tokens=16384, **common) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(texts, params)]
        once = roomy.get_stats()["computed_prefill_tokens"]
    computed = {}
    for hicache in (False, True):
        with Engine(max_total_tokens=768, enable_hierarchical_cache=hicache, hicache_ratio=4.0, **common) as engine:
            assert [o["output_ids"] for o in engine.generate(texts, params)] == expected
            computed[hicache] = engine.get_stats()["computed_prefill_tokens"]
    assert computed[True] <= 1.1 * once < computed[False] / 2, (once, computed)


def test_eviction_benchmark_runs_with_a_host_tier():
    """benchmark/bench_radix_evict.py --host-tier: every timed call moves a span to the full host tier."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    import bench_radix_evict

    assert bench_radix_evict.host_evict_ms(nodes=20, span_tokens=4, calls=5, seed=0) > 0
    assert bench_radix_evict.evict_ms(nodes=20, span_tokens=4, calls=5, seed=0) > 0
