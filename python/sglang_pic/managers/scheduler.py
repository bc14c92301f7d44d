"""The scheduler: continuous batching with chunked prefill over a position-free, span-aware KV cache.

Each step either extends requests (prefill chunks; with `enable_mixed_chunk` the running decodes ride along) or
decodes all running requests. Admission is checked against free + evictable KV; when decode runs out of slots the
newest running request is retracted (its KV goes to the tree, it re-queues and later resumes where it stopped).
Each step is launched before the previous one's sampled tokens are committed (overlap.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from sglang_pic.managers.isps import SpanPrefillPlanner
from sglang_pic.managers.overlap import LaunchedStep, PromptLogprobs
from sglang_pic.managers.profiler import StepProfiler
from sglang_pic.managers.req import FinishReason, Req, ReqSegment
from sglang_pic.managers.req_kv import ReqKVManager
from sglang_pic.managers.schedule_batch import BatchEntry, DecodeGroup, StepPlan, build_forward_batch, plan_entry
from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings
from sglang_pic.managers.spec_worker import SpecWorker, SpecWorkerFactory
from sglang_pic.mem_cache.host_pool import HostKVPool
from sglang_pic.radix_ext import RadixCache
from sglang_pic.sampling.logprobs import (
    RowLogprobs,
    SampledLogprobs,
    chosen_and_top_logprobs,
    compute_logprobs,
)
from sglang_pic.sampling.grammar import GrammarBackend, grammar_backend
from sglang_pic.sampling.penalty_counts import PenaltyCounts, uses_history
from sglang_pic.sampling.sampler import Sampler
from sglang_pic.sampling.sampling_batch_info import SamplingBatchInfo
from sglang_pic.sampling.stop_conditions import SEARCH_TIMEOUT_S
from sglang_pic.server_args import ServerArgs
from sglang_pic.tokenizer import fast_decode
from sglang_pic.utils_tensor import copy_to_host, upload

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096
# Jump forward only over this many forced tokens or more: with overlap a jump also voids the request's row in the
# step already launched, so it costs two steps against one decode step per forced token.
JUMP_MIN_TOKENS = 2
# At most this many forced tokens per jump (the rest come with the next), so a jump's extend stays step-sized.
JUMP_MAX_TOKENS = 64


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_prefill_tokens: int = 0
    cached_prefix_tokens: int = 0
    cached_span_tokens: int = 0
    span_segments: int = 0
    span_segment_hits: int = 0
    num_retractions: int = 0
    num_preemptions: int = 0  # running requests retracted for a waiting one of higher priority
    num_steps: int = 0
    prefill_step_s: float = 0.0  # wall time of steps that ran prefill tokens (mixed steps included)
    decode_step_s: float = 0.0  # wall time of decode-only steps
    num_decode_steps: int = 0
    jump_forward_tokens: int = 0  # output tokens a grammar forced, prefilled instead of decoded (jump-forward)
    shared_decode_steps: int = 0  # steps whose decodes read shared KV runs once (kernels/shared_decode.py)
    decode_keys_saved: int = 0  # key reads (per layer and kv head) those steps did not repeat


class Scheduler:
    def __init__(
        self, server_args: ServerArgs, model_runner, tokenizer=None, spec_worker: SpecWorkerFactory | None = None
    ) -> None:
        """`spec_worker`: builds the worker that decodes in speculative rounds (None: decode steps of its own)."""
        self.server_args = server_args
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.profiler = StepProfiler("engine")  # /start_profile, Engine.start_profile
        self._decode = fast_decode(tokenizer) if tokenizer is not None else None  # for stop strings
        self.page_size = server_args.page_size
        host_pool = None
        if server_args.enable_hierarchical_cache and not server_args.disable_radix_cache:
            host_pool = HostKVPool.for_budget(
                model_runner.token_to_kv_pool,
                model_runner.allocator.size,
                server_args.hicache_ratio,
                server_args.hicache_size,
            )
        self.tree = RadixCache(
            model_runner.allocator, self.page_size, disable=server_args.disable_radix_cache, host_pool=host_pool
        )
        self.kv = ReqKVManager(model_runner.req_to_token_pool, model_runner.allocator, self.tree)
        self.sampler = Sampler()
        self.shared_decode = SharedDecodeSettings.for_runner(model_runner)  # None: decodes read KV per request
        self.penalties = PenaltyCounts(model_runner.model_config.vocab_size, model_runner.device)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # requests past prefill, decoding
        self.chunked: Req | None = None  # a request whose prefill spans several steps
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness
        self.stats = SchedulerStats()
        self.vocab_size = model_runner.model_config.vocab_size
        self.context_len = model_runner.model_config.context_len
        self.isps = server_args.schedule_policy == "isps"
        self.prefill_budget = server_args.chunked_prefill_size or server_args.max_prefill_tokens
        if self.isps and server_args.step_token_budget:
            self.prefill_budget = server_args.step_token_budget
        self.chunking = server_args.chunked_prefill_size is not None
        # VeriCache decodes in its own draft/verify rounds, so decodes never ride along with prefill steps then.
        self.mix_decodes = (self.isps or server_args.enable_mixed_chunk) and spec_worker is None
        self.planner = SpanPrefillPlanner(self.kv, server_args.isps_max_wait_steps)
        self.priority_scheduling = server_args.enable_priority_scheduling
        # The most urgent request the last step could not admit (no seat or no KV room): it may preempt next step.
        self._preempt_for: Req | None = None
        # Reported with this step's output but not from its forward: finished outside one (e.g. can never fit the
        # pool), or committed early from the step in flight so that a retraction could run.
        self.finished_early: list[Req] = []
        self.spec_worker: SpecWorker | None = spec_worker(self) if spec_worker is not None else None
        self.overlap = not server_args.disable_overlap_schedule and self.spec_worker is None
        self.inflight: LaunchedStep | None = None  # a step whose sampled tokens are not committed yet
        self._grammars: GrammarBackend | None = None
        self.jump_forward = server_args.enable_jump_forward
        # Running constrained requests with forced tokens appended (jump-forward): their next step is one extend.
        self.jumping: list[Req] = []
        # Each request row's last sampled token, on the device: what the row's next decode step feeds.
        self.next_input_ids = torch.zeros(
            model_runner.req_to_token_pool.req_to_token.shape[0], dtype=torch.int64, device=model_runner.device
        )

    # ---- requests in and out ----------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.arrival_step = self.stats.num_steps
        if req.sampling_params.grammar() is not None:
            try:
                req.grammar = self.grammars().matcher(req.sampling_params)
            except ValueError as e:  # the front end compiles it too, so only a direct caller gets here
                req.finished_reason = FinishReason("abort", message=str(e))
                self.finished_early.append(req)
                return
        self.waiting.append(req)

    def grammars(self) -> GrammarBackend:
        """The grammar compiler (sampling/grammar.grammar_backend), kept for the masks of later steps."""
        if self.spec_worker is not None:
            raise ValueError("constrained decoding is not supported with speculative decoding")
        self._grammars = grammar_backend(self.tokenizer, self.vocab_size)
        return self._grammars

    def add_span_jobs(self, spans: list[ReqSegment]) -> list[Req]:
        """Queue prefill-only jobs for span segments; returns the jobs (shared with ISPS's own and other requests')."""
        return self._queue_span_jobs(spans)[0]

    def _queue_span_jobs(self, spans: list[ReqSegment]) -> tuple[list[Req], list[Req]]:
        """(the jobs computing `spans`, those of them queued just now)."""
        jobs, created = [], []
        for seg in spans:
            job, new = self.planner.job_for(seg, self.stats.num_steps)
            if new:
                self.waiting.append(job)
                created.append(job)
            jobs.append(job)
        return jobs, created

    def abort_request(self, rid: str) -> Req | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    if not self.running:
                        self.inflight = None  # only finished requests are left in it
                    return self._finish_abort(req)
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            return self._finish_abort(req)
        return None

    def _finish_abort(self, req: Req) -> Req:
        self.planner.forget(req)
        self._stop_jumping(req)
        if self.spec_worker is not None:
            self.spec_worker.release(req)
        self.kv.release(req)
        req.finished_reason = FinishReason("abort", message="aborted")
        return req

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked is None and self.inflight is None

    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        self.tree.reset()
        self.runner.allocator.clear()
        self.runner.req_to_token_pool.clear()
        return True

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> str:
        """Serve a new checkpoint of the same model (ModelRunner.update_weights_from_disk) and drop the cache: KV
        computed with the old weights must never be a hit. Only while idle; returns the message for the client."""
        if not self.is_idle():
            raise ValueError("requests are running; weights are updated between requests")
        self.runner.update_weights_from_disk(model_path, load_format)
        self.flush_cache()
        return f"serving the weights of {model_path}"

    def token_usage(self) -> float:
        pool = self.runner.allocator.size
        return 1.0 - (self.runner.allocator.available_size() + self.tree.evictable_size()) / pool

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; return the requests that produced output (or finished) since the last call.

        With overlap scheduling the step's sampled tokens are committed in the next call, after the next step has
        been launched, so the host's work on them runs while the GPU computes (managers/overlap.py)."""
        plan = self._schedule_extend()
        if plan is None and self.spec_worker is not None and self.running:
            updated, self.finished_early = self.finished_early, []
            updated += self.spec_worker.decode_round()
            self.profiler.step()
            return updated
        if plan is None:
            plan = StepPlan([], self._schedule_decode())
        updated, self.finished_early = self.finished_early, []
        if not plan:
            self._commit_inflight(updated)
            if not updated and self.waiting and not self.running and self.chunked is None:
                self._refuse_stalled(updated)
            return updated
        start = time.perf_counter()
        launched = self._launch(plan, updated)
        self._commit_inflight(updated)
        if self.overlap and launched.reqs:
            # Left uncommitted; dropped if everyone in it finished with the step just committed.
            self.inflight = launched if self.running else None
        else:
            self._commit(launched, updated)
            updated = list(dict.fromkeys(updated))  # the step in flight just committed may share its requests
        elapsed = time.perf_counter() - start
        if launched.decode_only:
            self.stats.decode_step_s += elapsed
            self.stats.num_decode_steps += 1
        else:
            self.stats.prefill_step_s += elapsed
        self.profiler.step()
        return updated

    def _commit_inflight(self, updated: list[Req]) -> None:
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self._commit(step, updated)

    def _pending_token(self, req: Req) -> bool:
        """Whether the request's last sampled token is still uncommitted (in the step in flight)."""
        return self.inflight is not None and id(req) in self.inflight.held

    def _going_on(self) -> list[Req]:
        """The running requests that get a next step: not those whose uncommitted token finishes them by length.
        Those leave at its commit, so their seats go to new requests already. One pass, run per step."""
        running = self.running
        if self.jumping:  # their forced tokens go in an extend instead
            jumping = set(map(id, self.jumping))
            running = [r for r in running if id(r) not in jumping]
        if self.inflight is None:
            return list(running)
        held, ctx = self.inflight.held, self.context_len
        return [
            r for r in running
            if not ((len(r.output_ids) + 1 >= r.sampling_params.max_new_tokens or r.seq_len() + 1 >= ctx)
                    and id(r) in held)
        ]

    def _reserved_decode_tokens(self) -> float:
        reqs = self.running + ([self.chunked] if self.chunked else [])
        return sum(
            min(r.sampling_params.max_new_tokens - len(r.output_ids), RESERVE_CLIP) for r in reqs
        ) * self.new_token_ratio

    def _schedule_extend(self) -> StepPlan | None:
        """This step's prefill entries, with the running decodes when they ride along; None if it has neither."""
        budget = self.prefill_budget
        if self._preempt_for is not None:  # before the decodes are planned: the preempted request leaves them
            self._preempt()
        # In mixed batches the running decodes get their slots first, so a new prefill never starves them.
        decode = self._schedule_decode() if self.mix_decodes and self.running else None
        # Making room for jumps may retract a running request: only while none is planned for this step.
        entries = self._schedule_jumps(budget, make_room=decode is None)
        budget -= sum(e.num_tokens for e in entries)
        if self.chunked is not None and budget > 0:
            entry = self._take(self.chunked, budget)
            if entry is None:
                return StepPlan(entries, decode) if entries or decode is not None else None
            entries.append(entry)
            budget -= entry.num_tokens
            if not entry.completes:
                return StepPlan(entries, decode)
            self.chunked = None
        # Fixed while this loop admits (running and chunked don't change); O(running), so only when someone waits.
        reserved = self._reserved_decode_tokens() if self.waiting else 0.0
        # Span jobs never join the running set, so a full one holds back only requests that would decode.
        seats = 0
        if self.waiting:
            going_on = len(decode.reqs) if decode is not None else len(self._going_on())
            seats = self.server_args.max_running_requests - going_on - sum(not e.req.warmup for e in entries)
        ordered = self._ordered_waiting()
        for req in ordered:  # grows by the span jobs that requests found missing, offered in this step too
            if budget <= 0:
                break
            if seats <= 0 and not req.warmup:
                self._may_preempt_for(req)
                continue
            if req.req_pool_idx is None:
                req.req_pool_idx = self.runner.req_to_token_pool.alloc()
                if req.req_pool_idx is None:
                    break
                self.kv.match(req)
            if req.warmup and req.pending() == 0:  # its span is cached already
                self.waiting.remove(req)
                self._finish_span_job(req)
                self.finished_early.append(req)
                continue
            missing = self.kv.missing_job_spans(req)
            if missing:  # it waits on their jobs, queued (and offered in this step): match again next step
                ordered += self._queue_span_jobs(missing)[1]
                self.kv.release(req)
                continue
            if self.kv.inflight_owner(req) is not None:
                self.kv.release(req)  # its span or prefix is being computed in that request: match again next step
                continue
            reserve = min(req.sampling_params.max_new_tokens, RESERVE_CLIP) * self.new_token_ratio
            need = self.kv.slots_needed(req, [len(s.tokens) - s.done for s in req.segments])
            if need + reserve + reserved > self.kv.available_size():
                if entries or self.running:
                    self.kv.release(req)
                    if not req.warmup and need + reserve <= self.runner.allocator.size:  # else it never fits
                        self._may_preempt_for(req)
                    break
            if not self.chunking and req.pending() > budget and entries:
                self.kv.release(req)
                break
            self.kv.claim(req)
            entry = self._take(req, budget if self.chunking else req.pending())
            if entry is None:
                self.kv.release(req)
                if not entries and not self.running and self.chunked is None:
                    self._reject_oversized(req)
                break
            self.waiting.remove(req)
            self._count_admission(req)
            entries.append(entry)
            seats -= not req.warmup
            budget -= entry.num_tokens
            if not entry.completes:
                self.chunked = req
                break
        return StepPlan(entries, decode) if entries or decode is not None else None

    def _schedule_jumps(self, budget: int, make_room: bool) -> list[BatchEntry]:
        """Extend entries for the forced tokens of jumping requests, up to `budget` prefill tokens (the last may
        overshoot it, by at most JUMP_MAX_TOKENS). Without room, with `make_room` room is made as decoding would
        make it (when every running request is jumping, nothing else would)."""
        entries: list[BatchEntry] = []
        while self.jumping and budget > 0:
            entry = self._take(self.jumping[0], self.jumping[0].pending())
            if entry is None:
                if not make_room:
                    break
                self._free_room()  # may retract a jumper, which leaves `jumping`
                continue
            entry.resumes = True
            entries.append(entry)
            budget -= entry.num_tokens
            self.jumping.pop(0)
        return entries

    def _refuse_stalled(self, updated: list[Req]) -> None:
        """Requests wait, yet nothing ran, nothing is running and nothing finished: no later step would differ, so
        they are refused rather than left waiting forever. Admission never leaves such a state (a queued request
        waits only on a request in this step's prefill, on room that running requests hold, or on a span job in the
        queue); this is the guarantee that a flaw there shows as an error, not a hang."""
        logger.error("no request could be scheduled; refusing %d waiting: %s",
                     len(self.waiting), ", ".join(r.rid for r in self.waiting))
        for req in self.waiting:
            self.planner.forget(req)
            self.kv.release(req)
            req.finished_reason = FinishReason("abort", message="the scheduler could not schedule this request")
        updated += self.waiting
        self.waiting.clear()

    def _reject_oversized(self, req: Req) -> None:
        self.waiting.remove(req)
        self.planner.forget(req)
        req.finished_reason = FinishReason("abort", message="request needs more KV memory than the whole pool")
        self.finished_early.append(req)

    def _ordered_waiting(self) -> list[Req]:
        """The waiting requests in the order admission offers them seats: by priority first (with priority
        scheduling), then by the schedule policy."""
        if self.isps:
            ordered, new_jobs = self.planner.order(self.waiting, self.stats.num_steps)
            self.waiting.extend(new_jobs)
        elif self.server_args.schedule_policy == "lpm" and len(self.waiting) > 1:
            def matched(req: Req) -> int:
                return -sum(
                    int(self.tree.match_prefix(s.key()).device_indices.numel()) for s in req.segments
                ) if not self.tree.disable else 0
            ordered = sorted(self.waiting, key=matched)
        else:
            ordered = list(self.waiting)
        return self._by_priority(ordered) if self.priority_scheduling else ordered

    def _urgency(self, req: Req) -> int:
        """A request's priority as "larger is more urgent" (a request without one has priority 0)."""
        priority = req.priority or 0
        return -priority if self.server_args.schedule_low_priority_values_first else priority

    def _by_priority(self, ordered: list[Req]) -> list[Req]:
        """`ordered` stably sorted by urgency; a span job is as urgent as the most urgent request waiting for it."""
        jobs: dict[str, int] = {}
        for req in self.waiting:
            urgency = self._urgency(req)
            for job in self.planner.blocked_on.get(req.rid, ()):
                jobs[job.rid] = max(jobs.get(job.rid, urgency), urgency)
        return sorted(ordered, key=lambda r: -jobs.get(r.rid, 0) if r.warmup else -self._urgency(r))

    def _may_preempt_for(self, req: Req) -> None:
        """Admission could not take `req`: with priority scheduling the most urgent such request (the first one
        offered) may preempt a running request at the start of the next step."""
        if self.priority_scheduling and self._preempt_for is None:
            self._preempt_for = req

    def _preempt(self) -> None:
        """Retract the least urgent running request when the request that could not be admitted outranks it by
        more than the threshold; one per step, so a request short of KV memory takes only as many as it turns
        out to need. Among equals the one preempted least often goes, then the newest: a resumed request is the
        newest in `running` again, and taking it each time would pile every delay on one request."""
        req, self._preempt_for = self._preempt_for, None
        if not self.running or req.finished_reason is not None or req not in self.waiting:
            return
        victim = min(reversed(self.running), key=lambda r: (self._urgency(r), r.preemptions))
        if self._urgency(req) - self._urgency(victim) <= self.server_args.priority_scheduling_preemption_threshold:
            return
        if self._pending_token(victim):
            self._commit_inflight(self.finished_early)
            if victim.finished_reason is not None:  # it finished with that token: its seat and KV are free now
                return
        self.running.remove(victim)
        victim.preemptions += 1
        self._give_back_kv(victim)
        self.waiting.insert(0, victim)
        self.stats.num_preemptions += 1
        logger.info("preempted request %s (priority %s) for request %s (priority %s)",
                    victim.rid, victim.priority, req.rid, req.priority)

    def _take(self, req: Req, budget: int) -> BatchEntry | None:
        entry = plan_entry(req, budget)
        slots = self.kv.alloc(req, entry.counts)
        if slots is None:
            return None
        entry.slots = slots
        return entry

    def _count_admission(self, req: Req) -> None:
        if req.warmup:
            return
        owned = self.planner.computed_for(req)  # also on readmission (retracted, preempted): it drops the records
        if req.matched_once:
            return
        req.matched_once = True
        req.cached_span_tokens -= sum(seg.cached for seg in owned)
        self.stats.prompt_tokens += req.prompt_len
        self.stats.cached_prefix_tokens += req.cached_prefix_tokens
        self.stats.cached_span_tokens += req.cached_span_tokens
        spans = [s for s in req.segments if s.kind == "span"]
        self.stats.span_segments += len(spans)
        self.stats.span_segment_hits += sum(1 for s in spans if s.cached == len(s.tokens) and s not in owned)

    def _schedule_decode(self) -> DecodeGroup | None:
        """Give every running request a slot for its last sampled token, retracting the newest while short."""
        while self.running:
            if self.kv.ensure_free(self.kv.decode_slots_needed(self.running)):
                break
            self._free_room()
        self.decay_new_token_ratio()
        reqs = self._going_on()
        if not reqs:
            return None
        return DecodeGroup(reqs, self.kv.alloc_decode(reqs))

    def _free_room(self) -> None:
        """Make KV room for running requests: commit the step in flight (requests finishing in it free theirs;
        retraction needs every token committed), else retract the newest request."""
        if self.inflight is not None:
            self._commit_inflight(self.finished_early)
        else:
            self._retract_one()

    def decay_new_token_ratio(self) -> None:
        """After each decode step (or VeriCache round) admission relaxes its reserve of decode tokens."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def _retract_one(self) -> None:
        """Give back the KV of the newest running request; a half-prefilled request goes before the last decode."""
        if len(self.running) == 1 and self.chunked is not None:
            req, self.chunked = self.chunked, None
        else:
            req = self.running.pop()
        self._give_back_kv(req)
        if not self.running and req.output_ids and self.chunked is None:
            req.finished_reason = FinishReason("abort", message="KV cache pool is full")
            self.finished_early.append(req)
            return
        self.stats.num_retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.info("retracted request %s to free KV memory", req.rid)

    def _give_back_kv(self, req: Req) -> None:
        """Put a request's KV in the tree and release its row (retraction, preemption): admitted again, it resumes
        from the cache."""
        assert not self._pending_token(req), "retracting a request whose last token is not committed"
        self._stop_jumping(req)  # its forced tokens are prefilled with the rest when it is admitted again
        if self.spec_worker is not None:
            self.spec_worker.release(req)
        self.kv.cache(req)
        self.kv.release(req)

    # ---- results ----------------------------------------------------------------------------------------------
    def _launch(self, plan: StepPlan, updated: list[Req]) -> LaunchedStep:
        """Run the plan's forward and sample on the device; settle what the host knows without the tokens: computed
        spans and prefixes go to the tree (stream order keeps their readers behind this step), finished span jobs
        to `updated`, requests whose prefill completed join `running`."""
        batch = build_forward_batch(plan, self.runner, self.next_input_ids, self.shared_decode)
        logits = self.runner.forward(batch)
        self.stats.num_steps += 1
        if batch.shared_decode is not None:
            self.stats.shared_decode_steps += 1
            self.stats.decode_keys_saved += batch.shared_decode.keys_per_request - batch.shared_decode.keys_read
        row = 0
        sample_rows, sampled = [], []
        logprob_rows: list[tuple[BatchEntry, int]] = []
        for e in plan.entries:
            if not e.resumes and (e.num_tokens > 1 or not e.completes or not e.req.output_ids):
                self.stats.computed_prefill_tokens += e.num_tokens
            if e.logprob_positions:
                logprob_rows.append((e, row))
                row += len(e.logprob_positions)
            if e.completes and not e.req.warmup:
                sample_rows.append(row)
                sampled.append(e.req)
                row += 1
        prompt_logprobs = self._prompt_logprobs(logprob_rows, logits) if logprob_rows else []
        # Hand freshly computed spans and prefixes to the tree now, so waiting requests can reuse them.
        for e in plan.entries:
            if e.completes:
                self.kv.prefill_done(e.req)
            if e.completes and e.req.warmup:
                self._finish_span_job(e.req)
                updated.append(e.req)
            elif (e.num_tokens > 1 or not e.completes) and not e.resumes:
                self.kv.cache(e.req)
        self.running += [e.req for e in plan.entries if e.completes and not e.req.warmup and not e.resumes]
        reqs = sampled + (plan.decode.reqs if plan.decode is not None else [])
        if logprob_rows and reqs:  # keep the sampled rows only: the entries' last tokens, then one row per decode
            rows = sample_rows + list(range(row, row + len(reqs) - len(sampled)))
            logits = logits[upload(rows, device=logits.device)]
        logits = logits[:, : self.vocab_size].float()
        if self.inflight is not None and self.inflight.constrained and any(r.grammar is not None for r in reqs):
            # The grammars must take the step in flight's tokens before this step's masks: commit it now, while
            # the device runs this step's forward, rather than before launching it.
            self._commit_inflight(updated)
        # Requests that jumped forward at that commit: this step's row of theirs is void (their forced tokens come
        # first, in an extend next step).
        dropped = {id(r) for r in self.jumping} & {id(r) for r in reqs} if self.jumping else set()
        ids = self._sample_ids(reqs, logits, dropped) if reqs else logits.new_empty(0, dtype=torch.int64)
        rows, logprobs = self._sampled_logprobs(reqs, logits, ids)
        copies = copy_to_host(ids, *(logprobs.tensors if logprobs is not None else []))
        return LaunchedStep(reqs, copies, rows, logprobs, batch.forward_mode.is_decode(), prompt_logprobs, dropped)

    @staticmethod
    def _prompt_logprobs(rows: list[tuple[BatchEntry, int]], logits: torch.Tensor) -> list[PromptLogprobs]:
        """Each entry's prompt logprobs, computed on the device and on their way to the host (recorded at commit);
        the entries' requests stop asking for them once their last prompt position is covered."""
        out = []
        for e, start in rows:
            req = e.req
            n = len(e.logprob_positions)
            ids = req.prompt_ids()
            targets = [ids[p + 1] for p in e.logprob_positions]
            lp = compute_logprobs(logits[start : start + n])
            sampled = SampledLogprobs.compute(
                lp, upload(targets, device=lp.device), [req.top_logprobs_num] * n, [req.token_ids_logprob] * n
            )
            first = ids[0] if req.logprob_start_len == 0 and e.logprob_positions[0] == 0 else None
            out.append(PromptLogprobs(req, targets, first, sampled, copy_to_host(*sampled.tensors)))
            if e.logprob_positions[-1] >= req.prompt_len - 2 or e.completes:
                req.input_logprobs_done = True
        return out

    def _commit(self, step: LaunchedStep, updated: list[Req]) -> None:
        """Append each sampled token to its request (with its logprobs when it returns them) and finish the request
        if it stops. Rows of requests that finished or were aborted since the launch are dropped. Finished requests
        leave `running` in one pass, so a step costs O(batch) however many finish in it."""
        for prompt in step.prompt_logprobs:
            prompt.record()
        host = [c.get() for c in step.copies]
        next_ids = host[0].tolist()
        logprobs = dict(zip(step.logprob_rows, step.logprobs.by_row(host[1:]))) if step.logprobs is not None else {}
        reqs = step.reqs
        if step.dropped or any(r.finished_reason is not None for r in reqs):
            live = [i for i, r in enumerate(reqs) if r.finished_reason is None and id(r) not in step.dropped]
            reqs, next_ids = [reqs[i] for i in live], [next_ids[i] for i in live]
            logprobs = {j: logprobs[i] for j, i in enumerate(live) if i in logprobs}
        finished = []
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            if req.sampling_params.max_new_tokens == 0:  # prefill-only call: the sampled token is not output
                req.finished_reason = FinishReason("length", matched=None)
            else:
                self._append_token(req, tok, logprobs.get(i))
            if req.finished_reason is not None:
                finished.append(req)
        updated += reqs
        if finished:
            gone = set(finished)
            self.running[:] = [r for r in self.running if r not in gone]
            for req in finished:
                self._release_finished(req)

    def _sample_ids(self, reqs: list[Req], logits: torch.Tensor, dropped: set[int]) -> torch.Tensor:
        """Each row's next token, on the logits' device, also recorded as its request's next decode input (and in
        the penalty counts), so the next step can run before the host has it. Rows of finished requests and
        `dropped` ones are void: they get no mask."""
        matchers = [r.grammar if r.finished_reason is None and id(r) not in dropped else None for r in reqs]
        if self._grammars is not None and any(m is not None for m in matchers):
            self._grammars.mask_logits(logits, matchers)
        if all(r.sampling_params.is_plain_greedy for r in reqs):  # the common case needs no per-request tensors
            ids = torch.argmax(logits, dim=-1)
        else:
            uncommitted = [int(self._pending_token(r)) for r in reqs] if self.inflight is not None else None
            info = SamplingBatchInfo.from_requests(
                reqs, self.vocab_size, logits.device, self.penalties, uncommitted=uncommitted
            )
            if dropped:  # a void row leaves its request's generator alone: seeded outputs stay those of any schedule
                info.seeded_rows = [i for i in info.seeded_rows if id(reqs[i]) not in dropped]
            ids = self.sampler(logits, info)
            if any(map(uses_history, reqs)):
                self.penalties.add_sampled(reqs, ids)
        slots = [r.req_pool_idx for r in reqs]
        if None in slots:  # requests that finished at a commit within this launch: their rows are dropped
            live = [i for i, slot in enumerate(slots) if slot is not None]
            index = upload(live, [slots[i] for i in live], device=ids.device).view(2, -1)
            self.next_input_ids[index[1]] = ids[index[0]]
        else:
            self.next_input_ids[upload(slots, device=ids.device)] = ids
        return ids

    @staticmethod
    def _sampled_logprobs(
        reqs: list[Req], logits: torch.Tensor, ids: torch.Tensor
    ) -> tuple[list[int], SampledLogprobs | None]:
        """The rows whose requests return logprobs, and those rows' logprobs of their sampled tokens (on the device)."""
        rows = [i for i, r in enumerate(reqs) if r.return_logprob]
        if not rows:
            return rows, None
        if len(rows) < len(reqs):
            index = upload(rows, device=logits.device)
            logits, ids = logits[index], ids[index]
        return rows, SampledLogprobs.compute(
            compute_logprobs(logits), ids, [reqs[i].top_logprobs_num for i in rows],
            [reqs[i].token_ids_logprob for i in rows],
        )

    def commit_token(self, req: Req, tok: int, logprobs: torch.Tensor | None = None) -> bool:
        """Append one generated token to a running request; finish it (and drop it from `running`) if it stops.

        `logprobs` is the raw log-softmax row that produced `tok` (needed only when the request returns logprobs).
        Returns whether the request finished.
        """
        chosen = None
        if req.return_logprob:
            chosen = chosen_and_top_logprobs(logprobs[None], [tok], [req.top_logprobs_num], [req.token_ids_logprob])[0]
        if self._append_token(req, tok, chosen):
            self._finish(req)
            return True
        return False

    def _append_token(self, req: Req, tok: int, logprobs: RowLogprobs | None) -> bool:
        """Record `tok` as the request's next output (its KV comes with the next forward); returns whether it stops.

        `logprobs` is the row's logprobs (sampling/logprobs.RowLogprobs), given when the request returns logprobs.
        """
        if req.return_logprob:
            value, top, asked = logprobs
            req.output_token_logprobs.append((value, tok))
            if req.top_logprobs_num:
                req.output_top_logprobs.append(top)
            if req.token_ids_logprob is not None:
                req.output_token_ids_logprobs.append(asked)
        if req.first_token_time is None:
            req.first_token_time = time.time()
        req.append_output(tok)
        self.stats.generation_tokens += 1
        self._check_finished(req)
        if req.grammar is not None and req.finished_reason is None:
            if not req.grammar.accept_token(tok):  # only if a mask was not applied: never leave the grammar
                req.finished_reason = FinishReason("abort", message=f"token {tok} is outside the output's grammar")
            elif req.grammar.is_terminated():  # only stop tokens were allowed and one came (ignore_eos or not)
                req.finished_reason = FinishReason("stop", matched=tok)
            elif self.jump_forward and not req.return_logprob and not uses_history(req):
                self._jump_forward(req)
        return req.finished_reason is not None

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens `req`'s grammar forces next (at least JUMP_MIN_TOKENS): their KV comes in one extend,
        instead of a decode step each. They are outputs like sampled ones (stops and length apply)."""
        forced = req.grammar.find_jump_forward_tokens()[:JUMP_MAX_TOKENS]
        if len(forced) < JUMP_MIN_TOKENS:
            return
        for tok in forced:
            req.grammar.accept_token(tok)
            req.append_output(tok)
            self.stats.generation_tokens += 1
            self.stats.jump_forward_tokens += 1
            self._check_finished(req)
            if req.finished_reason is not None:
                return
        self.jumping.append(req)

    def _stop_jumping(self, req: Req) -> None:
        if req in self.jumping:
            self.jumping.remove(req)

    def _check_finished(self, req: Req) -> None:
        sp = req.sampling_params
        tok = req.output_ids[-1]
        n = len(req.output_ids)
        if n >= sp.min_new_tokens:
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                req.finished_reason = FinishReason("stop", matched=tok)
                return
            if not sp.ignore_eos and tok in req.eos_token_ids:
                req.finished_reason = FinishReason("stop", matched=tok)
                return
            if sp.stops is not None and self._decode is not None:
                self._check_stop_text(req)
                if req.finished_reason is not None:
                    return
        if n >= sp.max_new_tokens or req.seq_len() >= self.context_len:
            req.finished_reason = FinishReason("length", matched=None)

    def _check_stop_text(self, req: Req) -> None:
        """End `req` at the earliest stop string or regex in the text of its newest tokens, decoded as its output
        will be, and record how much of that text the stop cuts off."""
        sp = req.sampling_params
        window = sp.stops.window
        whole = window is None or len(req.output_ids) <= window
        ids = req.output_ids if whole else req.output_ids[-window:]
        tail = self._decode(
            ids,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
        try:
            match = sp.stops.search(tail, 0 if whole else 1)
        except TimeoutError:
            message = f"stop_regex search took over {SEARCH_TIMEOUT_S} s (a pattern that backtracks too much)"
            req.finished_reason = FinishReason("abort", message=message)
            return
        if match is not None:
            req.finished_reason = FinishReason("stop", matched=match.stop, cut=len(tail) - match.start)

    def _finish_span_job(self, job: Req) -> None:
        job.finished_reason = FinishReason("length", matched=None)
        self.planner.job_done(job)
        self._finish(job)

    def _finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release_finished(req)

    def _release_finished(self, req: Req) -> None:
        if self.spec_worker is not None:
            self.spec_worker.release(req)
        # The last sampled token has no KV; everything before it is cached for later requests.
        self.kv.cache(req)
        self.kv.release(req)
