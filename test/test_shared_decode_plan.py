"""The host side of shared decode attention: how a step's keys become runs, items and partial slots."""

from __future__ import annotations

import torch

from sglang_pic.kernels.shared_decode_plan import SharedDecodePlan
from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.managers.schedule_batch import decode_runs
from sglang_pic.managers.shared_decode_planner import KeyRun, SharedDecodeSettings, plan_shared_decode
from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.radix_ext.radix_tree import RadixKey
from sglang_pic.sampling.sampling_params import SamplingParams

EVERY_STEP = SharedDecodeSettings(members=4, min_chunk=1000, target_items=1, max_read=1.0)


def _items(plan: SharedDecodePlan) -> list[list[int]]:
    return plan.items.tolist()


def _members(plan: SharedDecodePlan, item: list[int]) -> list[list[int]]:
    lo, count = item[4], item[5]
    return plan.members[lo : lo + count].tolist()


def test_a_shared_run_is_one_item_whose_members_rotate_by_their_own_offset():
    # request 0 (row 7): span at 0..10, own keys 10..15; request 1 (row 3): own 0..4, span at 4..14, own 14..20
    runs = [[KeyRun("span", 0, 10)], [KeyRun("span", 4, 10)]]
    plan = plan_shared_decode([7, 3], [15, 20], runs, EVERY_STEP, "cpu")
    items = _items(plan)
    shared = [it for it in items if it[5] == 2]
    assert len(shared) == 1
    row, first, n, run_index, _, _ = shared[0]
    assert (row, first, n, run_index) == (7, 0, 10, 0)  # read once, from the first holder's row
    # each member's query rotates by (its position - the run's start in its own request)
    assert [m[:2] for m in _members(plan, shared[0])] == [[0, 14 - 0], [1, 19 - 4]]
    private = sorted((it[0], it[1], it[2]) for it in items if it[5] == 1)
    assert private == [(3, 0, 4), (3, 14, 6), (7, 10, 5)]  # the gaps and tails, each from its own row
    assert plan.keys_read == 10 + 4 + 6 + 5 and plan.keys_per_request == 35
    assert plan.counts.tolist() == [2, 3] and plan.max_partials == 3


def test_every_key_of_every_request_is_read_once_into_its_own_partial_slot():
    lens = [20, 25, 9]
    runs = [[KeyRun("a", 0, 8), KeyRun("b", 8, 8)], [KeyRun("b", 0, 8), KeyRun("a", 10, 8)], []]
    settings = SharedDecodeSettings(members=1, min_chunk=3, target_items=100, max_read=1.0)
    plan = plan_shared_decode([0, 1, 2], lens, runs, settings, "cpu")
    covered: dict[int, list[int]] = {b: [] for b in range(3)}
    slots: dict[int, list[int]] = {b: [] for b in range(3)}
    for item in _items(plan):
        assert item[2] <= 3  # chunks of min_chunk keys (target_items asks for more)
        for b, angle, slot in _members(plan, item):
            run_start = lens[b] - 1 - angle  # the query rotates by its position minus the run's start
            covered[b] += range(run_start + item[3], run_start + item[3] + item[2])
            slots[b].append(slot)
    for b, seq_len in enumerate(lens):
        assert sorted(covered[b]) == list(range(seq_len))  # every key exactly once
        assert sorted(slots[b]) == list(range(plan.counts[b].item()))


def test_members_beyond_an_item_go_to_another_item():
    runs = [[KeyRun("doc", 2, 16)] for _ in range(5)]
    settings = SharedDecodeSettings(members=2, min_chunk=1000, target_items=1, max_read=1.0)
    plan = plan_shared_decode(list(range(5)), [30] * 5, runs, settings, "cpu")
    shared = [it for it in _items(plan) if it[2] == 16]
    assert [it[5] for it in shared] == [2, 2, 1]
    assert sorted(m[0] for it in shared for m in _members(plan, it)) == [0, 1, 2, 3, 4]


def test_no_plan_when_sharing_saves_too_little():
    runs = [[KeyRun("doc", 0, 10)], [KeyRun("doc", 0, 10)]]
    lens = [100, 100]  # 10 of 200 keys repeat: 95% of the reads stay
    assert plan_shared_decode([0, 1], lens, runs, SharedDecodeSettings(4, 16, 8, max_read=0.9), "cpu") is None
    assert plan_shared_decode([0, 1], lens, runs, SharedDecodeSettings(4, 16, 8, max_read=0.96), "cpu") is not None
    # same key, different length: not the same slots, nothing shared
    other = [[KeyRun("doc", 0, 10)], [KeyRun("doc", 0, 12)]]
    assert plan_shared_decode([0, 1], [12, 12], other, SharedDecodeSettings(4, 16, 8, max_read=0.99), "cpu") is None


def test_short_runs_and_runs_no_other_request_holds_are_read_with_the_private_keys():
    # "doc" (20 keys) is shared; "note" (4 keys, below min_shared) and "solo" (one holder) are not
    runs = [[KeyRun("note", 0, 4), KeyRun("doc", 4, 20), KeyRun("solo", 30, 10)], [KeyRun("note", 2, 4),
            KeyRun("doc", 10, 20)]]
    settings = SharedDecodeSettings(members=4, min_chunk=1000, target_items=1, max_read=1.0, min_shared=8)
    plan = plan_shared_decode([0, 1], [45, 33], runs, settings, "cpu")
    items = _items(plan)
    assert [(it[0], it[1], it[2], it[5]) for it in items if it[5] == 2] == [(0, 4, 20, 2)]
    private = sorted((it[0], it[1], it[2]) for it in items if it[5] == 1)
    assert private == [(0, 0, 4), (0, 24, 21), (1, 0, 10), (1, 30, 3)]  # "solo" is inside request 0's tail


def test_flat_round_trip():
    runs = [[KeyRun("x", 0, 5)], [KeyRun("x", 3, 5)], []]
    plan = plan_shared_decode([4, 5, 6], [9, 11, 4], runs, EVERY_STEP, "cpu")
    again = SharedDecodePlan.from_flat(plan.flat(), plan.sizes())
    for name in ("items", "members", "counts"):
        assert torch.equal(getattr(again, name), getattr(plan, name))
    assert (again.max_partials, again.members_per_item) == (plan.max_partials, plan.members_per_item)


def _cached_request(tree: RadixCache, segments: list[tuple[str, list[int]]]) -> Req:
    """A request whose segments are all in the tree, locked as admission locks them."""
    segs, start = [], 0
    for kind, tokens in segments:
        seg = ReqSegment(kind, tokens, None if kind == "prefix" else f"span:{kind}", start=start)
        match = tree.match_prefix(seg.key())
        seg.lock_node, seg.cached, seg.done = match.last_node, len(tokens), len(tokens)
        segs.append(seg)
        start += len(tokens)
    return Req(rid=str(id(segs)), segments=segs, sampling_params=SamplingParams(), prompt_len=start)


def test_requests_share_the_tree_nodes_they_have_in_common():
    tree = RadixCache(TokenToKVPoolAllocator(1024, 1, "cpu"), 1)
    system, doc = list(range(100, 140)), list(range(200, 230))
    q1, q2, q3 = [1, 2, 3], [4, 5, 6, 7], [8, 9]
    for key, n in ((system + q1, 43), (system + q2, 44), (system + q3, 42)):
        tree.insert(RadixKey(tuple(key)), torch.arange(n) + 1)
    tree.insert(RadixKey(tuple(doc), "span:doc"), torch.arange(30) + 500)
    a = _cached_request(tree, [("prefix", system + q1), ("doc", doc)])
    b = _cached_request(tree, [("prefix", system + q2)])
    c = _cached_request(tree, [("prefix", system + q3), ("doc", doc)])
    runs = decode_runs([a, b, c], shortest=8)
    # the system prompt is one node all three hold; each question is a node of its own; the doc span is shared
    system_node = a.segments[0].lock_node.parent
    assert [r.key for r in runs[0]] == [system_node, a.segments[0].lock_node, a.segments[1].lock_node]
    assert [(r.start, r.length) for r in runs[0]] == [(0, 40), (40, 3), (43, 30)]
    assert [(r.key, r.start, r.length) for r in runs[1]] == [(system_node, 0, 40), (b.segments[0].lock_node, 40, 4)]
    assert runs[2][2] == KeyRun(c.segments[1].lock_node, 42, 30)  # the same doc node, at another offset than in a
    settings = SharedDecodeSettings(members=4, min_chunk=1000, target_items=1, max_read=1.0, min_shared=8)
    plan = plan_shared_decode([0, 1, 2], [44, 45, 73], runs, settings, "cpu")
    assert sorted(it[5] for it in plan.items.tolist() if it[5] > 1) == [2, 3]  # doc by a and c, system by all


def test_nodes_held_by_the_same_requests_stay_one_run():
    tree = RadixCache(TokenToKVPoolAllocator(1024, 1, "cpu"), 1)
    doc = list(range(300, 350))
    tree.insert(RadixKey(tuple(doc[:20])), torch.arange(20) + 1)  # an older, shorter insert splits the path
    tree.insert(RadixKey(tuple(doc)), torch.arange(50) + 1)
    a = _cached_request(tree, [("prefix", doc)])
    b = _cached_request(tree, [("prefix", doc)])
    assert not a.segments[0].lock_node.parent.is_root  # two nodes on the path
    assert decode_runs([a, b], shortest=8) == [[KeyRun(a.segments[0].lock_node, 0, 50)]] * 2


def test_a_segment_whose_path_does_not_add_up_shares_nothing():
    """(node, length) names the path's last `length` tokens; a segment whose cached count is not its path's length
    would give that name to other slots (its first tokens), so its keys stay private."""
    tree = RadixCache(TokenToKVPoolAllocator(1024, 1, "cpu"), 1)
    doc = list(range(400, 420))
    tree.insert(RadixKey(tuple(doc[:10])), torch.arange(10) + 1)
    tree.insert(RadixKey(tuple(doc)), torch.arange(20) + 1)  # path: 10 tokens, then 10 more
    whole = _cached_request(tree, [("prefix", doc)])
    odd = _cached_request(tree, [("prefix", doc)])
    odd.segments[0].cached = 10  # locked at the deeper node, but only its parent's 10 tokens counted as cached
    runs = decode_runs([whole, odd], shortest=8)
    assert runs == [[KeyRun(whole.segments[0].lock_node, 0, 20)], []]


class _Stub:
    def __init__(self, **attrs) -> None:
        self.__dict__.update(attrs)


def test_a_step_whose_plan_does_not_fit_the_graph_records_no_sharing():
    """A decode step replays the per-request graph when its plan does not fit the static plan; the batch then
    says so (the engine's shared-step counters read it), and a plan that fits is loaded and kept."""
    from sglang_pic.forward_batch import ForwardMode
    from sglang_pic.layers.triton_backend import TritonAttnBackend
    from sglang_pic.model_executor.cuda_graph_runner import CudaGraphRunner

    loaded = []
    for fits in (False, True):
        runner = object.__new__(CudaGraphRunner)
        runner.batch_sizes, runner.extend_sizes = [4], []
        runner.shared_plan = _Stub(fits=lambda plan, size: fits, load=lambda *args: loaded.append(args))
        runner.adapter_variants, runner.num_adapter_replays = (False,), 0
        runner.decode_inputs = _Stub(load=lambda *args: None)
        runner.req_to_token_pool = _Stub(padding_row=0)
        runner.attn_backend = TritonAttnBackend()  # nothing to plan before a replay
        key = (ForwardMode.DECODE, 4, fits, False)
        runner.graphs, runner.outputs = {key: _Stub(replay=lambda: None)}, {key: torch.zeros(4, 2)}
        runner.num_replays, runner.num_shared_replays = {ForwardMode.DECODE: 0, ForwardMode.EXTEND: 0}, 0
        plan = object()
        batch = _Stub(forward_mode=ForwardMode.DECODE, batch_size=3, shared_decode=plan, input_ids=torch.zeros(3),
                      probe=None, span_scaling=None, deviation=None, span_adapter_rows_cpu=[0, 0, 0])
        assert runner.replay(batch).shape == (3, 2)
        assert batch.shared_decode is (plan if fits else None)
        assert runner.num_shared_replays == int(fits)
    assert len(loaded) == 1
