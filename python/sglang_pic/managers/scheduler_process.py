"""The scheduler process: owns the model and the Scheduler, turns incoming requests into per-step token deltas.

Loop: take every queued message (requests, aborts, control), run one scheduler step if there is work, and send a
`TokenDelta` for each request that got output. Each request arrives as a TokenizedGenerateReq, from which the
scheduler's Req is built (Req.from_wire) while the Reporter (output_format.py) keeps what shapes its reports:
streaming requests report every --stream-interval tokens, others only when they finish (their delta then carries
everything). When idle it blocks on its socket, waking each second to check that the main process still exists.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import zmq

from sglang_pic.distributed.launch import ReplicaPlacement, join_replica
from sglang_pic.managers.ipc import (
    AbortRequest,
    BatchTokenOutput,
    FlushCacheRequest,
    FlushCacheResult,
    IpcNames,
    ProfileRequest,
    ProfileResult,
    SchedulerReady,
    SchedulerSnapshot,
    StatsRequest,
    StatsResult,
    UpdateWeightsRequest,
    UpdateWeightsResult,
    WarmSpansRequest,
    WarmSpansResult,
    pull_socket,
    push_socket,
    recv_all_nowait,
)
from sglang_pic.managers.io_struct import TokenizedGenerateReq
from sglang_pic.managers.output_format import Reporter
from sglang_pic.managers.req import FinishReason, Req, ReqSegment
from sglang_pic.server_args import ServerArgs
from sglang_pic.speculative.spec_stats import SpecStats
from sglang_pic.utils_process import ModelFiles, check_parent, parent_alive, prepare_child

if TYPE_CHECKING:
    from sglang_pic.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
PARENT_CHECK_S = 1.0


class SchedulerLoop:
    def __init__(
        self, server_args: ServerArgs, files: ModelFiles, names: IpcNames, placement: ReplicaPlacement, parent_pid: int
    ) -> None:
        from sglang_pic.managers.scheduler import Scheduler
        from sglang_pic.managers.step_trace import for_replica
        from sglang_pic.model_config import ModelConfig
        from sglang_pic.model_executor.model_runner import ModelRunner
        from sglang_pic.speculative.algorithms import draft_memory, spec_worker_factory
        from sglang_pic.tokenizer import load_tokenizer

        args = server_args
        model_config = ModelConfig.from_server_args(files.model_dir, args)
        tokenizer = load_tokenizer(files.tokenizer_dir)
        # Tensor-parallel rank 0 of its replica (a no-op without parallelism). Its followers are the main process's
        # children, which stops this process when one of them dies, so the rendezvous only has to watch the parent.
        join_replica(args, placement, 0, partial(check_parent, parent_pid))
        self.runner = ModelRunner(args, model_config, draft_memory(args))
        self.scheduler = Scheduler(for_replica(args, placement.dp_rank), self.runner, tokenizer,
                                   spec_worker_factory(args))
        self.scheduler.profiler.name = f"DP-{placement.dp_rank}-TP-0"
        self.context_len = model_config.context_len
        ctx = zmq.Context()
        self.inbox = pull_socket(ctx, names.scheduler_input)
        self.to_detokenizer = push_socket(ctx, names.detokenizer_input)
        self.to_main = push_socket(ctx, names.tokenizer_input)
        self.reporter = Reporter(args.stream_interval)
        self.warming: dict[str, tuple[WarmSpansRequest, list[Req], int]] = {}  # request_id -> (msg, jobs, start)
        # A weight update waits for the requests the scheduler has to finish; requests arriving meanwhile wait here
        # and run with the new weights.
        self.update: UpdateWeightsRequest | None = None
        self.held: list[TokenizedGenerateReq] = []

    def ready_message(self) -> SchedulerReady:
        return SchedulerReady(max_total_num_tokens=self.runner.max_total_num_tokens, context_len=self.context_len)

    # ---- loop ---------------------------------------------------------------------------------------------
    def run(self, parent_pid: int) -> None:
        last_check = time.monotonic()
        while True:
            if self.scheduler.is_idle() and not self.inbox.poll(IDLE_POLL_MS):
                if not parent_alive(parent_pid):
                    return
                continue
            for msg in recv_all_nowait(self.inbox):
                self.handle(msg)
            if not self.scheduler.is_idle():
                self.report(self.scheduler.step())
            if self.warming:
                self.answer_warm_requests()
            if self.update is not None and self.scheduler.is_idle():
                self.apply_update()
            if time.monotonic() - last_check > PARENT_CHECK_S:
                last_check = time.monotonic()
                if not parent_alive(parent_pid):
                    return

    def handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedGenerateReq) and self.update is not None:
            self.held.append(msg)
        elif isinstance(msg, TokenizedGenerateReq):
            self.reporter.add(msg)
            self.scheduler.add_request(Req.from_wire(msg))
        elif isinstance(msg, UpdateWeightsRequest):
            if self.update is not None:
                self.to_main.send_pyobj(UpdateWeightsResult(msg.request_id, False, "another update is pending"))
            else:
                self.update = msg
        elif isinstance(msg, AbortRequest):
            self.abort(msg)
        elif isinstance(msg, FlushCacheRequest):
            self.to_main.send_pyobj(FlushCacheResult(msg.request_id, self.scheduler.flush_cache()))
        elif isinstance(msg, StatsRequest):
            self.to_main.send_pyobj(StatsResult(msg.request_id, self.snapshot()))
        elif isinstance(msg, ProfileRequest):
            self.to_main.send_pyobj(self.profile(msg))
        elif isinstance(msg, WarmSpansRequest):
            jobs = self.scheduler.add_span_jobs([ReqSegment.from_wire(seg) for seg in msg.spans])
            self.warming[msg.request_id] = (msg, jobs, self.scheduler.stats.computed_prefill_tokens)
        else:
            logger.error("scheduler got an unknown message %r", type(msg).__name__)

    def profile(self, msg: ProfileRequest) -> ProfileResult:
        profiler = self.scheduler.profiler
        try:
            path = profiler.start(**msg.options) if msg.start else profiler.stop()
        except (TypeError, ValueError) as e:
            return ProfileResult(msg.request_id, False, str(e))
        return ProfileResult(msg.request_id, True, path)

    def apply_update(self) -> None:
        msg, self.update = self.update, None
        try:
            message = self.scheduler.update_weights_from_disk(msg.model_path, msg.load_format)
            result = UpdateWeightsResult(msg.request_id, True, message)
        except ValueError as e:
            result = UpdateWeightsResult(msg.request_id, False, str(e))
        self.to_main.send_pyobj(result)
        held, self.held = self.held, []
        for request in held:
            self.handle(request)

    def answer_warm_requests(self) -> None:
        for request_id, (msg, jobs, start) in list(self.warming.items()):
            if all(job.finished() for job in jobs):
                del self.warming[request_id]
                computed = self.scheduler.stats.computed_prefill_tokens - start
                span_tokens = sum(len(seg.tokens) for seg in msg.spans)
                self.to_main.send_pyobj(WarmSpansResult(request_id, len(msg.spans), span_tokens, computed))

    def abort(self, msg: AbortRequest) -> None:
        sched = self.scheduler
        if msg.abort_all:
            rids = [r.rid for r in sched.waiting + sched.running] + ([sched.chunked.rid] if sched.chunked else [])
        else:
            rids = [msg.rid]
        aborted = [req for req in (sched.abort_request(rid) for rid in rids) if req is not None]
        for held in [h for h in self.held if msg.abort_all or h.rid == msg.rid]:
            self.held.remove(held)
            self.reporter.add(held)
            req = Req.from_wire(held)
            req.finished_reason = FinishReason("abort", message="aborted")
            aborted.append(req)
        self.report(aborted)

    # ---- output -------------------------------------------------------------------------------------------
    def report(self, updated: list[Req]) -> None:
        deltas = self.reporter.deltas(updated)
        if deltas:
            self.to_detokenizer.send_pyobj(BatchTokenOutput(deltas))

    def snapshot(self) -> SchedulerSnapshot:
        return scheduler_snapshot(self.scheduler, self.runner.allocator)


def scheduler_snapshot(sched: "Scheduler", allocator) -> SchedulerSnapshot:
    """Counters and load of `sched` whose KV slots come from `allocator`, as /metrics and /get_load report them."""
    stats = sched.stats
    spec = sched.spec_worker.stats if sched.spec_worker is not None else SpecStats()
    return SchedulerSnapshot(
        num_running_reqs=sched.num_running(),
        num_waiting_reqs=len(sched.waiting),
        num_waiting_tokens=sum(r.seq_len() for r in sched.waiting),
        max_total_num_tokens=allocator.size,
        available_tokens=allocator.available_size(),
        evictable_tokens=sched.tree.evictable_size(),
        token_usage=sched.token_usage(),
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        cached_prefix_tokens=stats.cached_prefix_tokens,
        cached_span_tokens=stats.cached_span_tokens,
        computed_prefill_tokens=stats.computed_prefill_tokens,
        num_retractions=stats.num_retractions,
        num_preemptions=stats.num_preemptions,
        shared_decode_steps=stats.shared_decode_steps,
        num_steps=stats.num_steps,
        host_cache_tokens=sched.tree.host_size(),
        host_cache_loaded_tokens=sched.tree.loaded_tokens,
        spec_verify_ct=spec.verify_ct,
        spec_draft_tokens=spec.draft_tokens,
        spec_accepted_drafts=spec.accepted_drafts,
        spec_committed_tokens=spec.committed_tokens,
        spec_draft_time_s=spec.draft_time_s,
        spec_verify_time_s=spec.verify_time_s,
        spec_h2d_bytes=spec.h2d_bytes,
    )


def run_scheduler_process(
    server_args: ServerArgs,
    files: ModelFiles,
    names: IpcNames,
    ready: Connection,
    placement: ReplicaPlacement,
) -> None:
    """Process entry point: load, report readiness (or the load error) on `ready`, then serve until orphaned.

    `names` carries this replica's own scheduler input; `placement` says which data-parallel replica it is.
    """
    parent_pid = prepare_child(server_args.log_level)
    try:
        loop = SchedulerLoop(server_args, files, names, placement, parent_pid)
    except Exception as e:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready.send(SchedulerReady(error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    ready.send(loop.ready_message())
    ready.close()
    try:
        loop.run(parent_pid)
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        sys.exit(1)
