"""The scheduler: continuous batching with chunked prefill over a position-free, span-aware KV cache.

Each step either extends requests (prefill chunks; with `enable_mixed_chunk` or ISPS the running decodes ride
along) or decodes all running requests. What a step runs is admission's choice (admission.py); the runner runs it
and samples on the device (model_executor/step_sampler.py); what the tokens do to their requests is finishing's
(finishing.py). Each step is launched before the previous one's sampled tokens are committed (overlap.py): the step
loop hands the launched step to the next call, whose scheduling commits it first only when it must.
"""

from __future__ import annotations

import time

from sglang_pic.forward_batch import ForwardBatch
from sglang_pic.managers.admission import Admission
from sglang_pic.managers.finishing import Finisher
from sglang_pic.managers.isps import SpanPrefillPlanner
from sglang_pic.managers.overlap import LastStep, LaunchedStep, PromptLogprobs, StepRows
from sglang_pic.managers.profiler import StepProfiler
from sglang_pic.managers.req import FinishReason, Req, ReqSegment
from sglang_pic.managers.req_kv import ReqKVManager
from sglang_pic.managers.schedule_batch import StepPlan, build_forward_batch
from sglang_pic.managers.scheduler_state import RequestQueues, SchedulerStats
from sglang_pic.managers.span_probe import rekey
from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings
from sglang_pic.managers.spec_worker import SchedulerForSpec, SpecWorker, SpecWorkerFactory
from sglang_pic.managers.step_trace import StepTracer
from sglang_pic.mem_cache.host_pool import HostKVPool
from sglang_pic.model_executor.step_sampler import SampleRows, StepSampling
from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.sampling.grammar import GrammarBackend, grammar_backend
from sglang_pic.server_args import ServerArgs
from sglang_pic.tokenizer import fast_decode


class Scheduler:
    def __init__(
        self, server_args: ServerArgs, model_runner, tokenizer=None, spec_worker: SpecWorkerFactory | None = None
    ) -> None:
        """`spec_worker`: builds the worker that decodes in speculative rounds (None: decode steps of its own)."""
        self.server_args = server_args
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.profiler = StepProfiler("engine")  # /start_profile, Engine.start_profile
        self.tree = RadixCache(
            model_runner.allocator, server_args.page_size, disable=server_args.disable_radix_cache,
            host_pool=self._host_pool(),
        )
        self.kv = ReqKVManager(model_runner.req_to_token_pool, model_runner.allocator, self.tree)
        self.shared_decode = SharedDecodeSettings.for_runner(model_runner)  # None: decodes read KV per request
        self.stats = SchedulerStats()
        self.queues = RequestQueues()
        self.planner = SpanPrefillPlanner(self.kv, server_args.isps_max_wait_steps)
        self.finishing = Finisher(
            self.queues, self.kv, self.planner, self.stats, model_runner.model_config.context_len,
            fast_decode(tokenizer) if tokenizer is not None else None, server_args.enable_jump_forward, self._leave,
        )
        # VeriCache decodes in its own draft/verify rounds, so decodes never ride along with prefill steps then.
        self.admission = Admission(
            server_args, model_runner, self.kv, self.planner, self.queues, self.stats, self.finishing, self._leave,
            may_mix=spec_worker is None,
        )
        # What a speculative worker is built with: the scheduler's parts behind a narrow interface.
        self.spec_host = SchedulerForSpec(
            server_args, model_runner, self.kv, self.queues, self.admission, self.finishing
        )
        self.spec_worker: SpecWorker | None = spec_worker(self.spec_host) if spec_worker is not None else None
        self.overlap = not server_args.disable_overlap_schedule and self.spec_worker is None
        self._grammars: GrammarBackend | None = None
        self._last = self._in_flight(None)  # the step in flight, handed to the next call
        self.trace: StepTracer | None = None  # --step-trace: a line per forward step (managers/step_trace.py)
        if server_args.step_trace is not None:
            self.trace = StepTracer.open(server_args.step_trace, model_runner, self.overlap)

    def _host_pool(self) -> HostKVPool | None:
        args, runner = self.server_args, self.runner
        if not args.enable_hierarchical_cache or args.disable_radix_cache:
            return None
        return HostKVPool.for_budget(
            runner.token_to_kv_pool, runner.allocator.size, args.hicache_ratio, args.hicache_size
        )

    # ---- the queues, as other code reads them -------------------------------------------------------------------
    waiting = property(lambda self: self.queues.waiting)
    running = property(lambda self: self.queues.running)
    chunked = property(lambda self: self.queues.chunked)
    jumping = property(lambda self: self.queues.jumping)

    @property
    def last_step(self) -> LaunchedStep | None:
        """The launched step whose tokens are not committed yet (None: none)."""
        return self._last.step

    # ---- requests in and out ----------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.arrival_step = self.stats.num_steps
        if req.sampling_params.grammar() is not None:
            try:
                req.grammar = self.grammars().matcher(req.sampling_params)
            except ValueError as e:  # the front end compiles it too, so only a direct caller gets here
                req.finished_reason = FinishReason("abort", message=str(e))
                self.queues.to_report.append(req)
                return
        self.queues.waiting.append(req)

    def grammars(self) -> GrammarBackend:
        """The grammar compiler (sampling/grammar.grammar_backend), kept for the masks of later steps."""
        if self.spec_worker is not None:
            raise ValueError("constrained decoding is not supported with speculative decoding")
        self._grammars = grammar_backend(self.tokenizer, self.runner.model_config.vocab_size)
        return self._grammars

    def add_span_jobs(self, spans: list[ReqSegment]) -> list[Req]:
        """Queue prefill-only jobs for span segments; returns the jobs (shared with ISPS's own and other requests')."""
        return self.admission.queue_span_jobs(spans)[0]

    def abort_request(self, rid: str) -> Req | None:
        q = self.queues
        for queue in (q.waiting, q.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    if not q.running:
                        self._last.drop()  # only finished requests are left in it
                    return self._abort(req)
        if q.chunked is not None and q.chunked.rid == rid:
            req, q.chunked = q.chunked, None
            return self._abort(req)
        return None

    def _abort(self, req: Req) -> Req:
        self.planner.forget(req)
        self.queues.stop_jumping(req)
        self._leave(req)
        self.kv.release(req)
        req.finished_reason = FinishReason("abort", message="aborted")
        return req

    def _leave(self, req: Req) -> None:
        """`req` leaves the running set (finish, abort, retraction, preemption)."""
        if self.spec_worker is not None:
            self.spec_worker.release(req)

    def is_idle(self) -> bool:
        q = self.queues
        return not q.waiting and not q.running and q.chunked is None and self._last.step is None

    def num_running(self) -> int:
        return len(self.queues.running) + (self.queues.chunked is not None)

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

    # ---- the step loop ----------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; return the requests that produced output (or finished) since the last call.

        With overlap scheduling the step's sampled tokens are committed in the next call, after the next step has
        been launched, so the host's work on them runs while the GPU computes (managers/overlap.py)."""
        if self.trace is not None:
            self.trace.call_started()
        self._last = self._step(self._last)
        if self.trace is not None:
            self.trace.call_ended(self.is_idle())
        return self.queues.take_reports()

    def _step(self, last: LastStep) -> LastStep:
        """One step, given the step launched before it (`last`, settled here at the latest); returns the step it
        leaves in flight, its tokens uncommitted (or an empty LastStep)."""
        plan = self.admission.plan_extend(last)
        if plan is None and self.spec_worker is not None and self.queues.running:
            if self.trace is not None:
                self.trace.spec_round(len(self.queues.running))
            self.queues.to_report += self.spec_worker.decode_round()
            self.profiler.step()
            return self._in_flight(None)
        if plan is None:
            plan = StepPlan([], self.admission.plan_decode(last))
        if not plan:
            last.settle()
            q = self.queues
            if not q.to_report and q.waiting and not q.running and q.chunked is None:
                self.admission.refuse_stalled()
            return self._in_flight(None)
        start = time.perf_counter()
        step = self._launch(plan, last)
        last.settle()
        ongoing = self._in_flight(step)
        if not (self.overlap and step.reqs):
            ongoing.settle()  # nothing to run ahead of its commit
        elapsed = time.perf_counter() - start
        if step.decode_only:
            self.stats.decode_step_s += elapsed
            self.stats.num_decode_steps += 1
        else:
            self.stats.prefill_step_s += elapsed
        self.profiler.step()
        if not self.queues.running:  # everyone in it finished with the step just committed: its rows are void
            ongoing.drop()
        return ongoing

    def _in_flight(self, step: LaunchedStep | None) -> LastStep:
        return LastStep(step, self.finishing.commit)

    def _launch(self, plan: StepPlan, last: LastStep) -> LaunchedStep:
        """Run the plan's forward and sample on the device. Between the two (`describe`, which the runner calls
        once the forward is queued) the host settles what it knows without the tokens and, when grammar masks need
        them, commits `last`."""
        batch = build_forward_batch(plan, self.runner, self.runner.sampler.next_input_ids, self.shared_decode)
        rows = StepRows.of(plan)

        def describe() -> SampleRows:
            self._hand_over(plan, batch)
            return self._describe_rows(rows.reqs, last)

        if self.trace is not None:
            self.trace.forward_called(plan, batch)
        out = self.runner.forward(batch, StepSampling(rows.asks, rows.sample_rows, describe))
        if self.trace is not None:
            self.trace.forward_queued()
        prompts = [
            PromptLogprobs(entry.req, ask.targets, first, *result)
            for entry, ask, first, result in zip(
                (e for e in plan.entries if e.logprob_positions), rows.asks, rows.firsts, out.prompt_logprobs
            )
        ]
        return LaunchedStep(rows.reqs, out, batch.forward_mode.is_decode(), prompts)

    def _hand_over(self, plan: StepPlan, batch: ForwardBatch) -> None:
        """What the host settles at launch, without the tokens: computed spans and prefixes go to the tree (stream
        order keeps their readers behind this step), finished span jobs are reported, requests whose prefill
        completed join `running`, and entries that scored their last prompt positions stop asking for them."""
        q, stats = self.queues, self.stats
        stats.num_steps += 1
        if batch.shared_decode is not None:
            stats.shared_decode_steps += 1
            stats.decode_keys_saved += batch.shared_decode.keys_per_request - batch.shared_decode.keys_read
        # Taken before the loop: a probe pass completing here re-keys its request (it samples from then on) but
        # goes back to `waiting`, not into `running`.
        joined = [e.req for e in plan.entries if e.completes and e.req.samples() and not e.resumes]
        for e in plan.entries:
            req = e.req
            if not e.resumes and (e.num_tokens > 1 or not e.completes or not req.output_ids):
                stats.computed_prefill_tokens += e.num_tokens
            if e.logprob_positions and (e.logprob_positions[-1] >= req.prompt_len - 2 or e.completes):
                req.input_logprobs_done = True
            if e.completes:
                self.kv.prefill_done(req)
            if e.completes and req.warmup:
                self.finishing.finish_span_job(req)
                q.to_report.append(req)
            elif e.completes and req.probe is not None:
                self._probed(req)
            elif (e.num_tokens > 1 or not e.completes) and not e.resumes:
                self.kv.cache(req)
        q.running += joined

    def _probed(self, req: Req) -> None:
        """A probe pass completed (managers/span_probe.py): its KV goes to the tree, and the request, re-keyed with
        the tokens it chose, waits first in line for its prefill. Choosing reads the scores: the host waits for
        this step's forward."""
        self.kv.cache(req)
        self.kv.release(req)
        rekey(req)
        self.queues.waiting.insert(0, req)

    def _describe_rows(self, reqs: list[Req], last: LastStep) -> SampleRows:
        """The sampled rows' description, once the forward is queued."""
        if last.constrained and any(r.grammar is not None for r in reqs):
            # The grammars must take the step in flight's tokens before this step's masks: commit it now, while
            # the device runs this step's forward, rather than before launching it.
            last.settle()
        # Requests that jumped forward at that commit: this step's row of theirs is void (their forced tokens come
        # first, in an extend next step).
        void: frozenset[int] = frozenset()
        if self.queues.jumping:
            jumped = set(map(id, self.queues.jumping))
            void = frozenset(i for i, r in enumerate(reqs) if id(r) in jumped)
        matchers = None
        if self._grammars is not None:
            matchers = [None if r.finished_reason is not None or i in void else r.grammar for i, r in enumerate(reqs)]
            if all(m is None for m in matchers):
                matchers = None
        return SampleRows(reqs, void, last.held, matchers, self._grammars)
