"""Liveness of the scheduler as a stateful property: random marker structures, arrivals, aborts and warm-ups.

Every step either runs work or finishes requests; a queued request that waits for another names a request in this
step's prefill; after a drain bounded in steps every request has finished or been refused with a reason, and the KV
accounting, the tree locks and the planner's tables are back to idle. Bad structures (empty spans, marker-only
prompts) are refused at the door with a message naming the problem. Each configuration runs a fixed, derandomized
set of examples, so CI sees the same cases every run.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from sglang_pic import Engine
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import ReqSegment
from sglang_pic.managers.scheduler import Scheduler
from sglang_pic.radix_ext.segments import Segment, segment_keys

SSEP, PDEP = -1, -2  # the default --ssep-token-id / --pdep-token-id
# Spans recur across requests, at different offsets; lengths straddle the page sizes under test (1 and 16).
SPAN_POOL = [tuple(range(10 + 7 * k, 10 + 7 * k + n)) for k, n in enumerate((1, 3, 7, 15, 16, 17, 33, 40))]
# Prefixes include a span's tokens: the same ids as a prefix are another namespace, never a false hit.
PREFIX_POOL = [(), (5, 6, 7, 8), SPAN_POOL[4], tuple(range(200, 240))]
FINISH_MESSAGES = {"aborted", "KV cache pool is full", "request needs more KV memory than the whole pool"}
DRAIN_STEPS = 3000
# Torch's global RNG, seeded at the start of each example: requests that sample (temperature 1) draw the same tokens
# whatever ran before in the process, so an example's output lengths, and with them its schedule, are fixed.
SEED = 0

CONFIGS = {
    "fcfs-p1": dict(schedule_policy="fcfs", page_size=1, max_total_tokens=4096),
    "lpm-p16-chunk": dict(schedule_policy="lpm", page_size=16, chunked_prefill_size=32, max_total_tokens=4096),
    "isps-p1-chunk": dict(schedule_policy="isps", page_size=1, chunked_prefill_size=32, step_token_budget=48,
                          max_total_tokens=4096),
    # Small pools with a low decode reserve: admission overcommits and decode retracts.
    "isps-p16-small": dict(schedule_policy="isps", page_size=16, max_total_tokens=512, schedule_conservativeness=0.2),
    "fcfs-p1-chunk-small": dict(schedule_policy="fcfs", page_size=1, chunked_prefill_size=16, max_total_tokens=256,
                                schedule_conservativeness=0.2),
    "isps-p1-small-nooverlap": dict(schedule_policy="isps", page_size=1, chunked_prefill_size=24,
                                    max_total_tokens=300, disable_overlap_schedule=True, schedule_conservativeness=0.2),
    "lpm-p1-priority": dict(schedule_policy="lpm", page_size=1, max_total_tokens=1024, max_running_requests=3,
                            enable_priority_scheduling=True, priority_scheduling_preemption_threshold=0),
}

# What each configuration's examples must exercise between them, so that a weaker generator fails here.
# "wait": on a request in prefill or on a span job (ISPS holding a request back for its span's job counts too);
# "from_job": requests whose spans only a span job computes.
EXPECTED = {
    "fcfs-p1": {"span_hit", "wait", "from_job"},
    "lpm-p16-chunk": {"span_hit", "wait"},
    "isps-p1-chunk": {"span_hit", "from_job"},  # siblings wait for budget, not a claim; ISPS holds back the rest
    "isps-p16-small": {"span_hit", "wait", "retraction"},
    "fcfs-p1-chunk-small": {"span_hit", "wait", "retraction", "from_job"},
    "isps-p1-small-nooverlap": {"span_hit", "retraction", "from_job"},
    "lpm-p1-priority": {"span_hit", "preemption", "wait", "from_job"},
}

text_ids = st.lists(st.integers(20, 300), min_size=0, max_size=12)
element = st.one_of(
    st.tuples(st.just("span"), st.sampled_from(SPAN_POOL)),
    st.tuples(st.just("pdep"), text_ids),  # an empty one is a bare PDEP marker, which canonical form drops
)
long_ids = st.lists(st.integers(20, 300), min_size=20, max_size=90)  # unshared prompts: they fill small pools
structure = st.tuples(
    st.one_of(st.sampled_from(PREFIX_POOL), text_ids.map(tuple), long_ids.map(tuple)),
    st.lists(element, min_size=0, max_size=4),
)
request = st.fixed_dictionaries({
    "structure": structure,
    "max_new_tokens": st.sampled_from([0, 1, 2, 3, 5, 8, 24]),
    "ignore_eos": st.booleans(),
    "n": st.sampled_from([1, 1, 1, 2]),
    "priority": st.integers(0, 20),
})
# Span quality settings (span_policy.py) of one arrival, sent where the server can serve them: (span_anchor,
# span_head_tokens), None: the server's default. One draw per arrival: hypothesis's buffer bounds an example.
span_policy = st.sampled_from([(None, None), ("none", 0), ("auto", 0), ("none", 2), ("auto", 2), (None, 40)])
bad_prompt = st.sampled_from([
    ([SSEP], "empty span"),
    ([PDEP], "empty"),
    ([], "either text or input_ids is required"),
    ([5, 6, SSEP, PDEP, 7], "empty span"),
    ([5, SSEP, 7, SSEP], "empty span"),
])


def to_input_ids(prefix: tuple[int, ...], elements: list) -> list[int]:
    ids = list(prefix)
    for kind, tokens in elements:
        ids += [SSEP if kind == "span" else PDEP, *tokens]
    return ids


class SchedulerMachine(RuleBasedStateMachine):
    engine: Engine  # set per configuration by the test below
    seen: Counter  # what the examples of one configuration exercised, summed over them

    @initialize()
    def start(self) -> None:
        """A fresh scheduler over the engine's model and emptied pools: examples are independent (and shrink)."""
        engine = self.engine
        torch.manual_seed(SEED)
        engine.runner.allocator.clear()
        engine.runner.req_to_token_pool.clear()
        engine.scheduler = self.sched = Scheduler(engine.server_args, engine.runner, engine.tokenizer)
        self.submitted = []
        self.aborted: set[str] = set()
        self.jobs = []
        self.launched: list = []
        self.blockers: list = []
        self.job_waits: list = []
        self.held_back = 0
        self._spy()
        # Every example opens with two siblings sharing an uncached prefix and a span that, where the server can,
        # only a span job computes: waits and spans from jobs whatever the later draws (which vary with the
        # process's earlier tests).
        anchor, head = ("auto", 2) if engine.server_args.spans_from_jobs() else (None, None)
        opening = GenerateReqInput(
            input_ids=[[*range(40, 60), SSEP, *range(100, 124), PDEP, 30 + i] for i in range(2)],
            sampling_params={"max_new_tokens": 2}, span_anchor=anchor, span_head_tokens=head)
        for req in engine.make_reqs(opening):
            self.sched.add_request(req)
            self.submitted.append(req)

    def _spy(self) -> None:
        """Record each step's prefill entries and each wait decision (who waits on whom) of admission."""
        sched, machine = self.sched, self
        launch = type(sched)._launch
        owner_of = type(sched.kv).inflight_owner
        missing_of = type(sched.kv).missing_job_spans

        def spy_launch(plan, last):
            machine.launched.extend(e.req for e in plan.entries)
            # requests ISPS holds back until their spans' jobs finish
            machine.held_back += sum(map(len, sched.planner.blocked_on.values()))
            return launch(sched, plan, last)

        def spy_owner(req):
            owner = owner_of(sched.kv, req)
            if owner is not None:
                machine.blockers.append((req, owner))
            return owner

        def spy_missing(req):
            missing = missing_of(req)
            machine.job_waits += [(req, seg.span_id) for seg in missing]
            return missing

        sched._launch = spy_launch
        sched.kv.inflight_owner = spy_owner
        sched.kv.missing_job_spans = spy_missing

    def teardown(self) -> None:
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        del sched._launch, sched.kv.inflight_owner, sched.kv.missing_job_spans
        for _ in range(DRAIN_STEPS):
            if sched.is_idle():
                break
            sched.step()
        assert sched.is_idle(), f"not drained in {DRAIN_STEPS} steps:\n{describe_stuck(sched)}"
        for req in self.submitted + self.jobs:
            reason = req.finished_reason
            assert reason is not None, f"request {req.rid} never finished"
            if reason.type == "abort":
                assert reason.message in FINISH_MESSAGES, reason.message
                assert reason.message != "aborted" or req.rid in self.aborted
        assert_idle(self.engine)
        self.seen.update(
            retraction=sched.stats.num_retractions, preemption=sched.stats.num_preemptions,
            span_hit=sched.stats.cached_span_tokens,  # whole pages of spans reused (a whole span rarely, at 16)
            from_job=sum(r.finished_reason.type != "abort" and any(s.from_job for s in r.segments)
                         for r in self.submitted),
            refused=sum(r.finished_reason.message != "aborted" for r in self.submitted
                        if r.finished_reason.type == "abort"),
        )

    @rule(reqs=st.lists(request, min_size=1, max_size=4), policy=span_policy)
    def arrive(self, reqs: list[dict], policy: tuple) -> None:
        """Concurrent arrivals: several requests queued before the next step."""
        for r in reqs:
            ids = to_input_ids(*r["structure"])
            if not any(t >= 0 for t in ids):
                continue  # marker-only: the bad_input rule covers it
            params = {"max_new_tokens": r["max_new_tokens"], "temperature": 0, "ignore_eos": r["ignore_eos"],
                      "n": r["n"]}
            anchor, head = policy if self.engine.server_args.spans_from_jobs() else (None, None)
            obj = GenerateReqInput(input_ids=ids, sampling_params=params, priority=r["priority"],
                                   span_anchor=anchor, span_head_tokens=head)
            for req in self.engine.make_reqs(obj):
                self.sched.add_request(req)
                self.submitted.append(req)

    @rule(prompts=st.lists(st.lists(st.integers(20, 300), min_size=50, max_size=90), min_size=2, max_size=4))
    def flood(self, prompts: list[list[int]]) -> None:
        """Long unshared prompts with long outputs at once: small pools overcommit, then decode must retract."""
        obj = GenerateReqInput(input_ids=prompts, sampling_params={"max_new_tokens": 16, "ignore_eos": True})
        for req in self.engine.make_reqs(obj):
            self.sched.add_request(req)
            self.submitted.append(req)

    @rule(prefix=st.lists(st.integers(20, 300), min_size=40, max_size=70),
          span_ids=st.lists(st.integers(20, 300), min_size=20, max_size=40), k=st.integers(2, 3))
    def siblings(self, prefix: list[int], span_ids: list[int], k: int) -> None:
        """Requests sent together that share an uncached prefix and span: all but one wait for the one computing them."""
        prompts = [prefix + [SSEP, *span_ids, PDEP, 30 + i] for i in range(k)]
        obj = GenerateReqInput(input_ids=prompts, sampling_params={"max_new_tokens": 2})
        for req in self.engine.make_reqs(obj):
            self.sched.add_request(req)
            self.submitted.append(req)

    @rule(case=bad_prompt)
    def bad_input(self, case) -> None:
        ids, message = case
        obj = GenerateReqInput(input_ids=ids or None, sampling_params={"max_new_tokens": 2})
        with pytest.raises(ValueError, match=message):
            self.engine.make_reqs(obj)

    @rule(spans=st.lists(st.sampled_from(SPAN_POOL), min_size=1, max_size=3))
    def warm(self, spans) -> None:
        anchor = self.engine.request_builder.span_policy.anchor
        self.jobs += self.sched.add_span_jobs(
            [ReqSegment("span", list(s), segment_keys([Segment("span", s, anchor)])[0].extra_key, key_lead=anchor)
             for s in spans])

    @rule(data=st.data())
    def abort(self, data) -> None:
        live = [r for r in self.submitted if not r.finished()]
        if live:
            req = data.draw(st.sampled_from(live))
            self.aborted.add(req.rid)
            self.sched.abort_request(req.rid)

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            if self.sched.is_idle():
                return
            before = self.sched.stats.num_steps
            self.launched, self.blockers, self.job_waits = [], [], []
            updated = self.sched.step()
            assert self.sched.stats.num_steps > before or updated, "a step of a busy scheduler did nothing"
            for req, owner in self.blockers:
                assert owner in self.launched, f"{req.rid} waits on {owner.rid}, which this step did not run"
            for req, span_id in self.job_waits:  # a span job is queued or running for it, or ran in this step
                job = self.sched.planner.jobs.get(span_id)
                assert job is not None and not job.finished() or any(
                    r.warmup and r.span_id == span_id for r in self.launched), f"{req.rid} waits on no span job"
            self.seen["wait"] += len(self.blockers) + len(self.job_waits) + self.held_back
            self.held_back = 0

    @invariant()
    def queue_is_consistent(self) -> None:
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        for req in sched.waiting:
            assert req.finished_reason is None and req.req_pool_idx is None


def describe_stuck(sched: Scheduler, steps: int = 3) -> str:
    """What a scheduler that does not drain holds, for the failure message: what admission makes of each queued
    request (span jobs included) over a few more steps, each waiting request's segments, the running requests, the
    planner's and the KV manager's tables and the KV accounting."""
    offers: dict[str, list[str]] = {}
    offer = type(sched.admission)._offer

    def spy_offer(req, room):
        result = offer(sched.admission, req, room)
        offers.setdefault(f"{req.rid}{' (span job)' if req.warmup else ''}", []).append(result.name)
        return result

    kv, tree, q, planner = sched.kv, sched.tree, sched.queues, sched.planner
    free = []
    sched.admission._offer = spy_offer
    try:
        for _ in range(steps):
            sched.step()
            free.append((kv.allocator.available_size(), tree.evictable_size()))
    finally:
        del sched.admission._offer
    lines = [f"{len(q.waiting)} waiting, {len(q.running)} running, chunked: {q.chunked and q.chunked.rid}",
             f"offers over {steps} more steps: {offers}", f"(free, evictable) after each: {free}"]
    for req in q.waiting:
        owner = kv.inflight_owner(req)
        lines.append(f"  waiting {req.rid}: pending {req.pending()}, max_new_tokens "
                     f"{req.sampling_params.max_new_tokens}, {len(req.output_ids)} output, owner "
                     f"{owner and owner.rid}, blocked on {[j.rid for j in planner.blocked_on.get(req.rid, ())]}")
        lines += [f"    {seg.kind} {len(seg.tokens)} tokens, done {seg.done}, cached {seg.cached}, key_lead "
                  f"{len(seg.key_lead)}, from_job {seg.from_job}" for seg in req.segments]
    lines += [f"  running: {[(r.rid, r.seq_len(), len(r.output_ids)) for r in q.running]}",
              f"  span jobs: {[j.rid for j in planner.jobs.values()]}",
              f"  in flight: spans {[r.rid for r in kv.inflight_spans.values()]}, "
              f"prefixes {list(kv.inflight_prefixes)}",
              f"  KV: free {kv.allocator.available_size()}, evictable {tree.evictable_size()}, protected "
              f"{tree.protected_size()} of {kv.allocator.size}; new_token_ratio {sched.admission.new_token_ratio:.3f}"]
    return "\n".join(lines)


def assert_idle(engine: Engine) -> None:
    sched = engine.scheduler
    alloc = engine.runner.allocator
    assert alloc.available_size() + sched.tree.total_size() == alloc.size
    assert sched.tree.protected_size() == 0
    assert not sched.kv.inflight_spans and not sched.kv.inflight_prefixes
    planner = sched.planner
    assert not planner.jobs and not planner.owner and not planner.blocked_on and not planner.held
    assert not planner._refs
    assert not sched.jumping and not sched.queues.to_report
    pool = engine.runner.req_to_token_pool
    assert pool.available_size() == pool.size


FAST_LANE = {"fcfs-p1", "isps-p16-small"}  # the rest run with -m slow (and in CI)


@pytest.mark.parametrize(
    "config", [pytest.param(c, marks=() if c in FAST_LANE else pytest.mark.slow) for c in CONFIGS], ids=list(CONFIGS)
)
def test_every_request_finishes_or_is_refused(tiny_llama, config):
    with Engine(model_path=str(tiny_llama), dtype="float32", **CONFIGS[config]) as engine:
        SchedulerMachine.engine, SchedulerMachine.seen = engine, Counter()
        run_state_machine_as_test(
            SchedulerMachine,
            settings=settings(max_examples=12, stateful_step_count=20, deadline=None, derandomize=True,
                              database=None, suppress_health_check=list(HealthCheck)),
        )
    seen = SchedulerMachine.seen
    assert all(seen[what] > 0 for what in EXPECTED[config]), f"{config} exercised only {dict(seen)}"


def run_bounded(engine: Engine, obj: GenerateReqInput, max_steps: int = 200) -> list:
    """Run requests through the scheduler for at most `max_steps` steps (a hang fails instead of blocking)."""
    reqs = engine.make_reqs(obj)
    for req in reqs:
        engine.scheduler.add_request(req)
    for _ in range(max_steps):
        if all(r.finished() for r in reqs):
            break
        engine.scheduler.step()
    assert all(r.finished() for r in reqs), f"unfinished after {max_steps} steps"
    return reqs


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "isps"])
@pytest.mark.parametrize("warm_first", [False, True])
def test_prompt_ending_in_a_span_finishes(tiny_llama, policy, warm_first):
    """The ISPS hang: a prompt whose last segment is a span, with or without a prefix, cold or warmed."""
    span = "only a span of several words at the very end"
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, schedule_policy=policy,
                span_head_tokens=0) as engine:
        if warm_first:
            engine.warm_spans([span])
        params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        ids = engine.tokenizer.encode(span, add_special_tokens=False)
        for obj in (
            GenerateReqInput(text="Hi<|ssep|>" + span, sampling_params=params),
            GenerateReqInput(text="<|ssep|>" + span, sampling_params=params),
            GenerateReqInput(input_ids=[5, 6, SSEP, *ids], sampling_params=params),
        ):
            (req,) = run_bounded(engine, obj)
            assert req.finished_reason.type == "length" and len(req.output_ids) == 3
        assert engine.scheduler.stats.computed_prefill_tokens < 3 * (len(ids) + 4)  # the span is computed once
        assert_idle(engine)


def test_span_jobs_wait_for_room_the_running_requests_hold(tiny_llama):
    """The fcfs-p1-chunk-small hang: a request whose spans from jobs fit the free and evictable KV one at a time but
    not together, while a running request holds the rest of the pool. Its jobs were queued each step and evicted
    each other's spans, so every step was a prefill step and the running request, which decodes only in steps
    without prefill, never freed the room. It waits for that room instead, and both finish."""
    with Engine(model_path=str(tiny_llama), dtype="float32", schedule_policy="fcfs", page_size=1,
                max_total_tokens=256, schedule_conservativeness=0.2) as engine:
        params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        (running,) = engine.make_reqs(GenerateReqInput(input_ids=list(range(170, 320)), sampling_params=params))
        engine.scheduler.add_request(running)
        engine.scheduler.step()  # its whole prompt: it decodes from the next step on
        assert engine.scheduler.running == [running]
        free = engine.scheduler.kv.available_size()
        spans = [list(range(20, 80)), list(range(90, 150))]  # each of their jobs fits the free KV, not both
        assert len(spans[0]) < free < sum(map(len, spans))
        obj = GenerateReqInput(input_ids=[5, 6, SSEP, *spans[0], PDEP, 7, SSEP, *spans[1], PDEP, 8],
                               sampling_params=params, span_anchor="auto", span_head_tokens=2)
        (req,) = run_bounded(engine, obj, max_steps=200)
        assert req.finished_reason.type == "length" and running.finished_reason.type == "length"
        assert any(s.from_job for s in req.segments)
        assert_idle(engine)
