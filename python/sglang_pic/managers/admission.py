"""Admission: which requests a step runs, and the KV and seats they take.

Each step the running decodes get their slots first (retracting the newest running request while short), then the
requests whose grammar forced tokens (jump-forward) get their extend, then the chunked prefill continues, then
waiting requests are offered what is left, in the order of the schedule policy (waiting_order.py). An offer
(`Offer`) admits a request, skips it (it waits: for a seat, for span jobs, for a request computing the same KV) or
stops the step's admission (no row, no KV room, no budget). Admission is checked against free + evictable KV with
a reserve for the decodes to come (`new_token_ratio`, relaxed after each decode step and raised by retraction). A
request that could not be admitted may preempt a less urgent running one at the start of the next step.

Tokens of the step in flight are committed through the LastStep handed in (overlap.py) before a request whose
token is in it is retracted or preempted, and before a decode short of KV retracts anyone: requests finishing in
that step may free enough.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from sglang_pic.managers.finishing import Finisher
from sglang_pic.managers.isps import SpanPrefillPlanner
from sglang_pic.managers.overlap import LastStep
from sglang_pic.managers.req import FinishReason, Req, ReqSegment
from sglang_pic.managers.req_kv import ReqKVManager
from sglang_pic.managers.schedule_batch import BatchEntry, DecodeGroup, StepPlan, plan_entry
from sglang_pic.managers.scheduler_state import RequestQueues, SchedulerStats
from sglang_pic.managers.span_deviation import select_by_deviation, wants_deviation_pass
from sglang_pic.managers.span_probe import add_probe_counts
from sglang_pic.managers.waiting_order import WaitingOrder
from sglang_pic.server_args import ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096


class Offer(Enum):
    """What admission made of one waiting request it offered room in a step; `stops`: nothing after it is offered."""

    ADMITTED = (False, "admitted with the rest of its prefill")
    CHUNKED = (True, "admitted; its prefill goes on in later steps")
    NO_BUDGET = (True, "the step's prefill token budget is spent")
    NO_SEAT = (False, "every running seat is taken")
    NO_ROW = (True, "no request row is free")
    SPAN_CACHED = (False, "a span job whose span is in the tree already: done without a step")
    WAITS_FOR_JOBS = (False, "waits for the jobs of its spans (queued now, offered after it)")
    WAITS_FOR_OWNER = (False, "waits for a request in prefill that computes the same span or prefix")
    NO_KV_ROOM = (True, "its prefill (with its spans' jobs) and decode reserve exceed the free and evictable KV")
    OVER_BUDGET = (True, "its whole prefill (no chunking) exceeds what is left of the budget")
    NO_SLOTS = (True, "its slots could not be allocated")
    TOO_LARGE = (True, "needs more KV than the whole pool: refused")

    @property
    def stops(self) -> bool:
        return self.value[0]


@dataclass
class Room:
    """What is left of one step for the requests still to be offered."""

    budget: int  # prefill tokens
    entries: list[BatchEntry] = field(default_factory=list)
    seats: int = 0  # running seats (span jobs take none)
    reserved: float = 0.0  # KV the running requests' decodes are expected to take
    queue: list[Req] = field(default_factory=list)  # waiting requests in offer order; grows by span jobs

    def add(self, entry: BatchEntry) -> None:
        self.entries.append(entry)
        self.budget -= entry.num_tokens


class Admission:
    def __init__(
        self,
        args: ServerArgs,
        runner,
        kv: ReqKVManager,
        planner: SpanPrefillPlanner,
        queues: RequestQueues,
        stats: SchedulerStats,
        finishing: Finisher,
        leave: Callable[[Req], None],
        may_mix: bool,
    ) -> None:
        """`leave`: told of each request that leaves the running set; `may_mix`: decodes may ride along with
        prefills (not when a speculative worker decodes in rounds of its own)."""
        self.args = args
        self.runner = runner
        self.req_rows = runner.req_to_token_pool
        self.pool_size = runner.allocator.size
        self.kv = kv
        self.planner = planner
        self.order = WaitingOrder(args, kv.tree, planner)
        self.q = queues
        self.stats = stats
        self.finishing = finishing
        self.leave = leave
        self.context_len = runner.model_config.context_len
        isps = args.schedule_policy == "isps"
        self.prefill_budget = args.chunked_prefill_size or args.max_prefill_tokens
        if isps and args.step_token_budget:
            self.prefill_budget = args.step_token_budget
        self.chunking = args.chunked_prefill_size is not None
        self.mix_decodes = (isps or args.enable_mixed_chunk) and may_mix
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        # The most urgent request the last step could not admit (no seat or no KV room): it may preempt next step.
        self.preempt_for: Req | None = None

    # ---- one step's plan ----------------------------------------------------------------------------------------
    def plan_extend(self, last: LastStep) -> StepPlan | None:
        """This step's prefill entries, with the running decodes when they ride along; None if it has neither."""
        if self.preempt_for is not None:  # before the decodes are planned: the preempted request leaves them
            self._preempt(last)
        # In mixed batches the running decodes get their slots first, so a new prefill never starves them.
        decode = self.plan_decode(last) if self.mix_decodes and self.q.running else None
        room = Room(self.prefill_budget)
        # Making room for jumps may retract a running request: only while none is planned for this step.
        self._plan_jumps(room, last, make_room=decode is None)
        if self._continue_chunk(room) and self.q.waiting:
            self._offer_waiting(room, decode, last)
        return StepPlan(room.entries, decode) if room.entries or decode is not None else None

    def plan_decode(self, last: LastStep) -> DecodeGroup | None:
        """Give every running request a slot for its last sampled token, making room while short."""
        while self.q.running:
            if self.kv.ensure_free(self.kv.decode_slots_needed(self.q.running)):
                break
            self._free_room(last)
        self.decay_new_token_ratio()
        reqs = self._going_on(last)
        return DecodeGroup(reqs, self.kv.alloc_decode(reqs)) if reqs else None

    def _plan_jumps(self, room: Room, last: LastStep, make_room: bool) -> None:
        """Extend entries for the forced tokens of jumping requests while budget is left (the last may overshoot
        it, by at most finishing.JUMP_MAX_TOKENS). Without room, with `make_room` room is made as decoding would
        make it (when every running request is jumping, nothing else would)."""
        jumping = self.q.jumping
        while jumping and room.budget > 0:
            entry = self._take(jumping[0], jumping[0].pending())
            if entry is None:
                if not make_room:
                    break
                self._free_room(last)  # may retract a jumper, which leaves `jumping`
                continue
            entry.resumes = True
            room.add(entry)
            jumping.pop(0)

    def _continue_chunk(self, room: Room) -> bool:
        """The chunked request's next chunk; whether waiting requests may follow it in this step."""
        req = self.q.chunked
        if req is None or room.budget <= 0:
            return True
        entry = self._take(req, room.budget)
        if entry is None:
            return False
        room.add(entry)
        if not entry.completes:
            return False
        self.q.chunked = None
        return True

    def _offer_waiting(self, room: Room, decode: DecodeGroup | None, last: LastStep) -> None:
        # Fixed while this loop admits (running and chunked don't change).
        room.reserved = self._reserved_decode_tokens()
        # Span jobs never join the running set, so a full one holds back only requests that would decode.
        going_on = len(decode.reqs) if decode is not None else len(self._going_on(last))
        room.seats = self.args.max_running_requests - going_on - sum(not e.req.warmup for e in room.entries)
        room.queue = self.order.order(self.q.waiting, self.stats.num_steps)
        for req in room.queue:  # grows by the span jobs that requests found missing, offered in this step too
            if self._offer(req, room).stops:
                break

    def _offer(self, req: Req, room: Room) -> Offer:
        if room.budget <= 0:
            return Offer.NO_BUDGET
        if room.seats <= 0 and not req.warmup:
            self._may_preempt_for(req)
            return Offer.NO_SEAT
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_rows.alloc()
            if req.req_pool_idx is None:
                return Offer.NO_ROW
            self.kv.match(req)
            add_probe_counts(req)
        return self._wait(req, room) or self._select(req, room) or self._admit(req, room)

    def _wait(self, req: Req, room: Room) -> Offer | None:
        """Why a matched request waits (it is not admitted now; unless it waits for KV room, the requests after it
        still are offered); None: it does not."""
        if req.warmup and req.pending() == 0:  # its span is cached already
            self.q.waiting.remove(req)
            self.finishing.finish_span_job(req)
            self.q.to_report.append(req)
            return Offer.SPAN_CACHED
        missing = self.kv.missing_job_spans(req)
        if missing and self._short_of_kv_for_jobs(req, room, missing):
            return Offer.NO_KV_ROOM
        if missing:  # queued and offered in this step; the request matches again next step
            room.queue += self.queue_span_jobs(missing)[1]
            self.kv.release(req)
            return Offer.WAITS_FOR_JOBS
        if self.kv.inflight_owner(req) is not None:
            self.kv.release(req)  # it finds that KV in the tree when it matches again next step
            return Offer.WAITS_FOR_OWNER
        return None

    def _select(self, req: Req, room: Room) -> Offer | None:
        """A deviation-selected request's pass (managers/span_deviation.py), then its offer under the runs it chose;
        None: it selects no other way than by its prefill (a query probe's is one)."""
        if not wants_deviation_pass(req):
            return None
        if not select_by_deviation(req, self.runner, self.kv):
            self.kv.release(req)
            return Offer.NO_KV_ROOM
        return self._offer(req, room)

    def _short_of_kv_for_jobs(self, req: Req, room: Room, missing: list[ReqSegment]) -> bool:
        """Whether a request missing spans from a job waits for KV room before their jobs are queued: it would not
        fit with them computed. Queued anyway, its jobs would run and evict the spans the ones before computed
        (unlocked until the request runs), and be queued again at its next offer: every step a prefill step of its
        jobs, so the policies that decode only in steps without prefill never decode the running requests that
        hold the room it waits for (a hang)."""
        jobs = self.kv.job_slots_needed(missing)
        if not jobs:
            return False
        own = self.kv.slots_needed(req, [0 if s.from_job else len(s.tokens) - s.done for s in req.segments])
        return self._short_of_kv(req, room, own + jobs)

    def _short_of_kv(self, req: Req, room: Room, need: int) -> bool:
        """Whether `need` slots for a matched request, with its decode reserve and the running requests', exceed
        the free and evictable KV while other requests hold KV; then `req` is released (and may preempt)."""
        reserve = min(req.sampling_params.max_new_tokens, RESERVE_CLIP) * self.new_token_ratio
        if need + reserve + room.reserved <= self.kv.available_size() or not (room.entries or self.q.running):
            return False
        self.kv.release(req)
        if not req.warmup and need + reserve <= self.pool_size:  # else it never fits
            self._may_preempt_for(req)
        return True

    def _admit(self, req: Req, room: Room) -> Offer:
        """Admit a matched request if its KV and tokens fit what is left of the step."""
        if self._short_of_kv(req, room, self.kv.slots_needed(req, [len(s.tokens) - s.done for s in req.segments])):
            return Offer.NO_KV_ROOM
        if not self.chunking and req.pending() > room.budget and room.entries:
            self.kv.release(req)
            return Offer.OVER_BUDGET
        self.kv.claim(req)
        entry = self._take(req, room.budget if self.chunking else req.pending())
        if entry is None:
            self.kv.release(req)
            if room.entries or self.q.running or self.q.chunked is not None:
                return Offer.NO_SLOTS
            self._reject_oversized(req)
            return Offer.TOO_LARGE
        self.q.waiting.remove(req)
        self._count_admission(req)
        room.add(entry)
        room.seats -= not req.warmup
        if not entry.completes:
            self.q.chunked = req
            return Offer.CHUNKED
        return Offer.ADMITTED

    def _take(self, req: Req, budget: int) -> BatchEntry | None:
        entry = plan_entry(req, budget)
        slots = self.kv.alloc(req, entry.counts)
        if slots is None:
            return None
        entry.slots = slots
        return entry

    def _going_on(self, last: LastStep) -> list[Req]:
        """The running requests that get a next step: not those whose uncommitted token finishes them by length.
        Those leave at its commit, so their seats go to new requests already. One pass, run per step."""
        running = self.q.running
        if self.q.jumping:  # their forced tokens go in an extend instead
            jumping = set(map(id, self.q.jumping))
            running = [r for r in running if id(r) not in jumping]
        held, ctx = last.held, self.context_len
        if not held:
            return list(running)
        return [
            r for r in running
            if not ((len(r.output_ids) + 1 >= r.sampling_params.max_new_tokens or r.seq_len() + 1 >= ctx)
                    and id(r) in held)
        ]

    def _reserved_decode_tokens(self) -> float:
        reqs = self.q.running + ([self.q.chunked] if self.q.chunked else [])
        return sum(
            min(r.sampling_params.max_new_tokens - len(r.output_ids), RESERVE_CLIP) for r in reqs
        ) * self.new_token_ratio

    def _count_admission(self, req: Req) -> None:
        if req.warmup:
            return
        owned = self.planner.computed_for(req)  # also on readmission (retracted, preempted): it drops the records
        if req.matched_once:
            return
        req.matched_once = True
        req.cached_span_tokens -= sum(seg.cached for seg in owned)
        stats = self.stats
        stats.prompt_tokens += req.prompt_len
        stats.cached_prefix_tokens += req.cached_prefix_tokens
        stats.cached_span_tokens += req.cached_span_tokens
        spans = [s for s in req.segments if s.kind == "span"]
        stats.span_segments += len(spans)
        stats.span_segment_hits += sum(1 for s in spans if s.cached == len(s.tokens) and s not in owned)

    def queue_span_jobs(self, spans: list[ReqSegment]) -> tuple[list[Req], list[Req]]:
        """(the jobs computing `spans`, those of them queued just now)."""
        jobs, created = [], []
        for seg in spans:
            job, new = self.planner.job_for(seg, self.stats.num_steps)
            if new:
                self.q.waiting.append(job)
                created.append(job)
            jobs.append(job)
        return jobs, created

    # ---- preemption, retraction and refusal -------------------------------------------------------------------
    def _may_preempt_for(self, req: Req) -> None:
        """Admission could not take `req`: with priority scheduling the most urgent such request (the first one
        offered) may preempt a running request at the start of the next step."""
        if self.args.enable_priority_scheduling and self.preempt_for is None:
            self.preempt_for = req

    def _preempt(self, last: LastStep) -> None:
        """Retract the least urgent running request when the request that could not be admitted outranks it by
        more than the threshold; one per step, so a request short of KV memory takes only as many as it turns
        out to need. Among equals the one preempted least often goes, then the newest: a resumed request is the
        newest in `running` again, and taking it each time would pile every delay on one request."""
        req, self.preempt_for = self.preempt_for, None
        running = self.q.running
        if not running or req.finished_reason is not None or req not in self.q.waiting:
            return
        urgency = self.order.urgency
        victim = min(reversed(running), key=lambda r: (urgency(r), r.preemptions))
        if urgency(req) - urgency(victim) <= self.args.priority_scheduling_preemption_threshold:
            return
        if last.holds(victim):
            last.settle()
            if victim.finished_reason is not None:  # it finished with that token: its seat and KV are free now
                return
        running.remove(victim)
        victim.preemptions += 1
        self._give_back_kv(victim)
        self.q.waiting.insert(0, victim)
        self.stats.num_preemptions += 1
        logger.info("preempted request %s (priority %s) for request %s (priority %s)",
                    victim.rid, victim.priority, req.rid, req.priority)

    def _free_room(self, last: LastStep) -> None:
        """Make KV room for running requests: commit the step in flight (requests finishing in it free theirs;
        retraction needs every token committed), else retract the newest request."""
        if not last.settle():
            self.retract_one()

    def retract_one(self) -> None:
        """Give back the KV of the newest running request, which re-queues and later resumes where it stopped; a
        half-prefilled request goes before the last decode. Every running request's tokens must be committed."""
        if len(self.q.running) == 1 and self.q.chunked is not None:
            req, self.q.chunked = self.q.chunked, None
        else:
            req = self.q.running.pop()
        self._give_back_kv(req)
        if not self.q.running and req.output_ids and self.q.chunked is None:
            req.finished_reason = FinishReason("abort", message="KV cache pool is full")
            self.q.to_report.append(req)
            return
        self.stats.num_retractions += 1
        self.q.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.info("retracted request %s to free KV memory", req.rid)

    def decay_new_token_ratio(self) -> None:
        """After each decode step (or speculative round) admission relaxes its reserve of decode tokens."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def _give_back_kv(self, req: Req) -> None:
        """Put a request's KV in the tree and release its row (retraction, preemption): admitted again, it resumes
        from the cache."""
        self.q.stop_jumping(req)  # its forced tokens are prefilled with the rest when it is admitted again
        self.leave(req)
        self.kv.cache(req)
        self.kv.release(req)

    def _reject_oversized(self, req: Req) -> None:
        self.q.waiting.remove(req)
        self.planner.forget(req)
        req.finished_reason = FinishReason("abort", message="request needs more KV memory than the whole pool")
        self.q.to_report.append(req)

    def refuse_stalled(self) -> None:
        """Requests wait, yet nothing ran, nothing is running and nothing finished: no later step would differ, so
        they are refused rather than left waiting forever. Admission never leaves such a state (a queued request
        waits only on a request in this step's prefill, on room that running requests hold, or on a span job in the
        queue); this is the guarantee that a flaw there shows as an error, not a hang."""
        waiting = self.q.waiting
        logger.error("no request could be scheduled; refusing %d waiting: %s",
                     len(waiting), ", ".join(r.rid for r in waiting))
        for req in waiting:
            self.planner.forget(req)
            self.kv.release(req)
            req.finished_reason = FinishReason("abort", message="the scheduler could not schedule this request")
        self.q.to_report += waiting
        waiting.clear()
