"""Priority scheduling: admission by priority, preemption of less urgent running requests (which resume with the
same tokens), span jobs as urgent as their most urgent waiter, and the `priority` field's checks."""

from __future__ import annotations

import re
import threading
import time

import pytest
from server_utils import start_server, stop_server

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import Req

from test_engine import assert_idle_accounting

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client, one chunk after another, while "
    "the scheduler keeps the batch full and the cache warm.",
]


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def build(engine: Engine, text: str, n: int, priority: int | None = None) -> Req:
    obj = GenerateReqInput(text=text, sampling_params=greedy(n), priority=priority)
    return engine.make_reqs(obj)[0]


def run(engine: Engine, reqs: list[Req], until=None) -> list[Req]:
    """Step until every request in `reqs` finished (or `until()` holds); returns them in the order they finished."""
    done: list[Req] = []
    while not all(r.finished() for r in reqs) and not (until and until()):
        for r in engine.scheduler.step():
            if r in reqs and r.finished() and r not in done:
                done.append(r)
    return done


def finish_order(priorities: list[int], **flags) -> list[int]:
    """Priorities of requests queued together, one running at a time, in the order they finish."""
    with Engine(model_path=flags.pop("path"), dtype="float32", max_total_tokens=4096, max_running_requests=1,
                **flags) as engine:
        reqs = [build(engine, f"Request number {i} asks.", 3, p) for i, p in enumerate(priorities)]
        for r in reqs:
            engine.scheduler.add_request(r)
        return [r.priority for r in run(engine, reqs)]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "isps"])
def test_admission_follows_priority_then_policy(tiny_llama, policy):
    flags = dict(path=str(tiny_llama), schedule_policy=policy)
    assert finish_order([0, 5, 1, 9, 5], enable_priority_scheduling=True, **flags) == [9, 5, 5, 1, 0]
    low_first = finish_order([0, 5, 1, 9], enable_priority_scheduling=True, schedule_low_priority_values_first=True,
                             **flags)
    assert low_first == [0, 1, 5, 9]
    if policy == "fcfs":  # without the flag the field is ignored: arrival order
        assert finish_order([0, 5, 1, 9], **flags) == [0, 5, 1, 9]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_urgent_request_preempts_and_the_preempted_one_resumes_unchanged(tiny_llama, overlap):
    common = dict(
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, disable_overlap_schedule=not overlap
    )
    low_text, high_text = "A long story about the sea and the town, told slowly.", "Quick question?"
    with Engine(**common) as ref:
        expected_low = ref.generate(low_text, greedy(40))["output_ids"]
        expected_high = ref.generate(high_text, greedy(4))["output_ids"]
    with Engine(max_running_requests=1, enable_priority_scheduling=True, **common) as engine:
        sched = engine.scheduler
        low = build(engine, low_text, 40, priority=0)
        sched.add_request(low)
        run(engine, [low], until=lambda: len(low.output_ids) >= 8)
        high = build(engine, high_text, 4, priority=100)
        sched.add_request(high)
        order = run(engine, [low, high])
        assert order == [high, low]
        assert sched.stats.num_preemptions == 1
        assert high.output_ids == expected_high and low.output_ids == expected_low
        assert_idle_accounting(engine)


def test_preemption_under_vericache_keeps_the_tokens(tiny_llama):
    """A preempted request drops its speculative state with its KV and drafts again once resumed: same tokens."""
    spec = dict(speculative_algorithm="vericache", speculative_num_draft_tokens=4, vericache_compressor="streaming",
                vericache_budget=32)
    common = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    low_text, high_text = "A long story about the sea and the town, told slowly.", "Quick question?"
    with Engine(**common) as ref:
        expected = [ref.generate(t, greedy(n))["output_ids"] for t, n in ((low_text, 40), (high_text, 4))]
    with Engine(max_running_requests=1, enable_priority_scheduling=True, **spec, **common) as engine:
        low = build(engine, low_text, 40, priority=0)
        engine.scheduler.add_request(low)
        run(engine, [low], until=lambda: len(low.output_ids) >= 8)
        high = build(engine, high_text, 4, priority=100)
        engine.scheduler.add_request(high)
        run(engine, [high], until=lambda: engine.scheduler.stats.num_preemptions == 1)
        assert low.rid not in engine.scheduler.spec_worker.drafts  # its draft went with its KV
        assert run(engine, [low, high]) == [high, low]
        assert [low.output_ids, high.output_ids] == expected
        assert_idle_accounting(engine)


def test_preemptions_are_spread_over_equally_urgent_requests(tiny_llama):
    """A resumed request is the newest running one again; the next preemption takes another request."""
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, max_running_requests=2,
                enable_priority_scheduling=True) as engine:
        lows = [build(engine, f"A long story number {i} about the sea.", 60, priority=0) for i in range(2)]
        for r in lows:
            engine.scheduler.add_request(r)
        run(engine, lows, until=lambda: all(len(r.output_ids) >= 2 for r in lows))
        for i in range(2):
            urgent = build(engine, f"Quick question {i}?", 3, priority=100)
            engine.scheduler.add_request(urgent)
            run(engine, [urgent])
            run(engine, lows, until=lambda: all(r in engine.scheduler.running for r in lows))
        assert [r.preemptions for r in lows] == [1, 1]
        run(engine, lows)
        assert all(len(r.output_ids) == 60 for r in lows)


def test_no_preemption_within_the_threshold(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, max_running_requests=1,
                enable_priority_scheduling=True, priority_scheduling_preemption_threshold=10) as engine:
        low = build(engine, "A long story about the sea.", 20, priority=0)
        engine.scheduler.add_request(low)
        run(engine, [low], until=lambda: len(low.output_ids) >= 4)
        high = build(engine, "Quick question?", 4, priority=10)
        engine.scheduler.add_request(high)
        assert run(engine, [low, high]) == [low, high]
        assert engine.scheduler.stats.num_preemptions == 0


def test_urgent_request_short_of_kv_memory_preempts(tiny_llama):
    """Seats are plenty; the KV pool holds one of the two long prompts at a time."""
    common = dict(model_path=str(tiny_llama), dtype="float32")
    low_text = " ".join(f"word{i}" for i in range(32))
    high_text = " ".join(f"word{i}" for i in reversed(range(32)))
    with Engine(max_total_tokens=4096, **common) as ref:
        expected = [o["output_ids"] for o in ref.generate([low_text, high_text], greedy(24))]
    with Engine(max_total_tokens=200, enable_priority_scheduling=True, **common) as engine:
        sched = engine.scheduler
        low = build(engine, low_text, 24, priority=1)
        high = build(engine, high_text, 24, priority=50)
        assert 80 < low.prompt_len < 110 and high.prompt_len == low.prompt_len
        sched.add_request(low)
        run(engine, [low], until=lambda: len(low.output_ids) >= 4)
        sched.add_request(high)
        assert run(engine, [low, high]) == [high, low]
        assert sched.stats.num_preemptions >= 1
        assert [low.output_ids, high.output_ids] == expected
        assert_idle_accounting(engine)


def test_a_request_larger_than_the_pool_preempts_nobody(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=200,
                enable_priority_scheduling=True) as engine:
        low = build(engine, " ".join(f"word{i}" for i in range(32)), 24, priority=1)
        huge = build(engine, " ".join(f"item{i}" for i in range(36)), 40, priority=50)
        assert huge.prompt_len > 200
        engine.scheduler.add_request(low)
        run(engine, [low], until=lambda: len(low.output_ids) >= 4)
        engine.scheduler.add_request(huge)
        assert run(engine, [low, huge]) == [low, huge]
        assert engine.scheduler.stats.num_preemptions == 0 and len(low.output_ids) == 24
        assert huge.finished_reason.message == "request needs more KV memory than the whole pool"


def test_span_job_is_as_urgent_as_the_request_waiting_for_it(tiny_llama):
    """ISPS with a budget smaller than either span: the urgent request's span is computed first, though the other
    request came first and misses fewer span tokens."""

    def span_order(priority_flag: bool) -> list[str]:
        with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, schedule_policy="isps",
                    step_token_budget=16, enable_priority_scheduling=priority_flag, span_head_tokens=0) as engine:
            early = build(engine, "First." + span(DOCS[0]) + "?", 2, priority=0)
            urgent = build(engine, "Second." + span(DOCS[1]) + "?", 2, priority=5)
            assert early.prompt_len < urgent.prompt_len
            names = {tuple(r.segments[1].tokens): name for name, r in (("early", early), ("urgent", urgent))}
            computed: list[str] = []
            kv = engine.scheduler.kv
            alloc = kv.alloc

            def spy(req, counts):
                for seg, n in zip(req.segments, counts):  # a span job computes its anchor and span as one prefix
                    ends = [nm for toks, nm in names.items() if n and tuple(seg.tokens[-len(toks):]) == toks]
                    name = ends[0] if ends else None
                    if name and name not in computed:
                        computed.append(name)
                return alloc(req, counts)

            kv.alloc = spy
            for r in (early, urgent):
                engine.scheduler.add_request(r)
            run(engine, [early, urgent])
            return computed

    assert span_order(False) == ["early", "urgent"]
    assert span_order(True) == ["urgent", "early"]


def test_priority_field_checks(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096) as engine:
        for bad in ("high", True, 1.5):
            with pytest.raises(ValueError, match="priority must be an integer"):
                engine.generate("Hi", greedy(1), priority=bad)
        out = engine.generate(["Hi", "Ho"], greedy(2), priority=[3, None])  # ignored while the flag is off
        assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 2]
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096,
                abort_on_priority_when_disabled=True) as engine:
        with pytest.raises(ValueError, match="--enable-priority-scheduling"):
            engine.generate("Hi", greedy(1), priority=1)
        assert engine.generate("Hi", greedy(1))["meta_info"]["completion_tokens"] == 1
    with pytest.raises(ValueError, match="priority_scheduling_preemption_threshold"):
        Engine(model_path=str(tiny_llama), priority_scheduling_preemption_threshold=-1)


@pytest.mark.slow
def test_server_preempts_for_urgent_requests_on_both_apis(tiny_llama):
    """One request served at a time: urgent native and OpenAI requests finish while a long one waits, the long one
    still gets all its tokens, and /metrics counts the preemptions; a non-integer priority is a 400."""
    srv = start_server(tiny_llama, "--max-running-requests", "1", "--enable-priority-scheduling")
    try:
        bad = srv.post("/generate", json={"text": "Hi", "priority": "high"})
        assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]
        long = {"temperature": 0, "max_new_tokens": 230, "ignore_eos": True}
        for _ in range(3):  # on a loaded machine the long request may end before the urgent ones arrive: retry
            results: list[dict] = []
            thread = threading.Thread(target=lambda: results.append(
                srv.post("/generate", json={"text": "Once upon a time", "sampling_params": long}).json()
            ))
            thread.start()
            deadline = time.monotonic() + 30
            while srv.get("/get_load").json()[0]["num_reqs"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            native = srv.post("/generate", json={"text": "Quick?", "sampling_params": greedy(4), "priority": 100})
            completion = srv.post("/v1/completions", json={"prompt": "Quick?", "max_tokens": 2, "priority": 100})
            overtook = thread.is_alive()
            thread.join(60)
            if overtook:
                break
        assert overtook, "the long request finished before the urgent ones came back, three times"
        assert native.json()["meta_info"]["completion_tokens"] == 4
        assert completion.json()["usage"]["completion_tokens"] == 2
        assert results[0]["meta_info"]["completion_tokens"] == 230
        metrics = srv.get("/metrics").text
        preemptions = float(re.search(r"^sglang:num_preemptions_total\S* (\S+)$", metrics, re.M).group(1))
        assert preemptions >= 2
    finally:
        stop_server(srv)
