"""The main process's side of the engine: validate and tokenize requests, send them to the scheduler process, and
hand each caller its outputs as the detokenizer produces them.

Everything here runs on the HTTP server's event loop. A background task reads the one inbound socket (outputs
from the detokenizer, control replies from the scheduler) and wakes the waiting callers. Outputs are cumulative, so
a slow streaming client simply skips to the newest one. A caller that goes away aborts its requests, which frees
their KV in the scheduler. With data parallelism there is one scheduler per replica (see dp_dispatcher). When a
server process dies (fail_requests) every caller waiting, and every later one, gets ServerFailed naming it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from sglang_pic.managers.dp_dispatcher import DataParallelDispatcher, combine_snapshots
from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq
from sglang_pic.managers.ipc import (
    AbortRequest,
    BatchGenerateOutput,
    FlushCacheRequest,
    FlushCacheResult,
    GenerateOutput,
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
)
from sglang_pic.managers.metrics import ServerMetrics
from sglang_pic.managers.parallel_encoding import ParallelEncoding
from sglang_pic.server_args import ServerArgs
from sglang_pic.utils_process import ModelFiles

logger = logging.getLogger(__name__)

DISCONNECT_CHECK_S = 1.0
CONTROL_TIMEOUT_S = 60.0


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests were aborted."""


class ServerBusy(Exception):
    """--max-queued-requests requests are queued already: the caller should come back later (HTTP 503)."""


class ServerFailed(RuntimeError):
    """A server process died, so no request can finish any more; the server is shutting down."""


class DisconnectProbe(Protocol):
    """Anything with Starlette's `is_disconnected()` (a fastapi.Request); None when no HTTP client is watched."""

    async def is_disconnected(self) -> bool: ...


class ClientWatch:
    """Asks the client whether it left at most once per DISCONNECT_CHECK_S, and at least that often while output
    keeps arriving: a non-streaming caller that left must not keep a long batch running just because some of its
    requests finish more often than once a second."""

    def __init__(self, client: DisconnectProbe | None) -> None:
        self.client = client
        self.next_check = time.monotonic() + DISCONNECT_CHECK_S

    async def check(self) -> None:
        """Raise ClientDisconnected if a check is due and the client has gone."""
        if self.client is None or time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + DISCONNECT_CHECK_S
        if await self.client.is_disconnected():
            raise ClientDisconnected()


@dataclass
class ReqState:
    """A request as its caller waits for it: the main process's side of its output."""

    rid: str
    stream: bool
    wake: asyncio.Event
    # The newest cumulative output not yet taken. Outputs carry every id and the whole text so far, and only the
    # newest is ever sent: a stream whose client reads slower than the steps need not hold the ones between.
    latest: dict[str, Any] | None = None
    finished: bool = False
    seen_tokens: int = 0
    last_time: float = 0.0


class ServerTokenizerManager:
    def __init__(self, server_args: ServerArgs, files: ModelFiles, names: IpcNames) -> None:
        from sglang_pic.managers.request_builder import RequestBuilder
        from sglang_pic.model_config import ModelConfig
        from sglang_pic.tokenizer import load_tokenizer

        self.server_args = server_args
        self.files = files
        self.model_config = ModelConfig.from_server_args(files.model_dir, server_args, "cpu")
        self.tokenizer = load_tokenizer(files.tokenizer_dir)
        self.request_builder = RequestBuilder(server_args, self.tokenizer, self.model_config)
        # SGLang's fork + join(mode="concate_and_append"), where spans can come from jobs (span_policy.py)
        self.parallel_encoding = ParallelEncoding(server_args) if server_args.spans_from_jobs() else None
        self.context_len = self.model_config.context_len
        self.max_total_num_tokens = 0  # known once the scheduler has sized its pool; see scheduler_ready()
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.metrics = ServerMetrics(self.served_model_name)
        self.names = names
        self.states: dict[str, ReqState] = {}
        self.pending: dict[str, asyncio.Future] = {}
        self.last_receive_time = 0.0
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._dispatcher: DataParallelDispatcher | None = None
        self._inbox: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: str | None = None  # why the server cannot serve any more; see fail_requests

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def scheduler_ready(self, ready: SchedulerReady) -> None:
        """Take the scheduler's sizes; built before it is ready so the two processes load in parallel."""
        self.context_len = ready.context_len
        self.max_total_num_tokens = ready.max_total_num_tokens

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._dispatcher = DataParallelDispatcher(
            self._sync_ctx, self.names, self.server_args.dp_size, self.server_args.load_balance_method
        )
        self._inbox = pull_socket(self._async_ctx, self.names.tokenizer_input)
        self._receiver = asyncio.create_task(self._receive_loop())

    async def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        if self._inbox is not None:
            self._inbox.close(linger=0)
        if self._dispatcher is not None:
            self._dispatcher.close()
        for ctx in (self._async_ctx, self._sync_ctx):
            if ctx is not None:
                ctx.term()

    def fail_requests(self, reason: str) -> None:
        """A server process died (`reason` says which and how): fail every waiting caller and refuse new requests.
        Safe to call from any thread."""
        loop = self._loop
        if loop is None:
            self.failure = reason  # not serving yet: nobody waits
            return
        try:
            loop.call_soon_threadsafe(self._fail, reason)
        except RuntimeError:  # the event loop has already closed
            self.failure = reason

    def _fail(self, reason: str) -> None:
        self.failure = reason
        for state in self.states.values():
            state.wake.set()
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ServerFailed(reason))

    def _check_serving(self) -> None:
        if self.failure is not None:
            raise ServerFailed(f"the server cannot serve requests: {self.failure}")

    async def _receive_loop(self) -> None:
        while True:
            msg = await self._inbox.recv_pyobj()
            self.last_receive_time = time.time()
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop every other request's output
                logger.exception("failed to handle a %s message", type(msg).__name__)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, BatchGenerateOutput):
            for out in msg.outputs:
                self._on_output(out)
        elif isinstance(msg, (FlushCacheResult, StatsResult, WarmSpansResult, UpdateWeightsResult, ProfileResult)):
            future = self.pending.pop(msg.request_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
        else:
            logger.error("tokenizer manager got an unknown message %r", type(msg).__name__)

    def _on_output(self, output: GenerateOutput) -> None:
        if output.finished:
            self._dispatcher.release(output.rid)
        state = self.states.get(output.rid)
        if state is None:
            return  # its caller left and aborted it
        now = time.time()
        meta = output.out["meta_info"]
        self.metrics.on_output(meta, now, state.last_time, state.seen_tokens, state.stream, output.finished)
        state.seen_tokens = meta["completion_tokens"]
        state.last_time = now
        state.latest = output.out
        if output.finished:
            state.finished = True
            del self.states[output.rid]
        state.wake.set()

    # ---- generation ---------------------------------------------------------------------------------------
    def prepare(
        self, obj: GenerateReqInput, queue_limit: bool = True, default_max_new_tokens: int | None = None
    ) -> list[TokenizedGenerateReq]:
        """Validate and tokenize; raise ValueError naming the problem (ContextOverflow for a prompt and limit past
        the context), ServerBusy when the queue is full (with `queue_limit`). Nothing is sent yet.
        `default_max_new_tokens`: the route's output limit where the request gives none (RequestBuilder.build)."""
        if self.parallel_encoding is not None:
            self.parallel_encoding.apply(obj)
        reqs = self.request_builder.build(obj, default_max_new_tokens)
        busy = [req.rid for req in reqs if req.rid in self.states]
        if busy:
            raise ValueError(f"rid {busy[0]!r} is already in use by a running request")
        for req in reqs:
            if req.prompt_len >= self.max_total_num_tokens:
                raise ValueError(
                    f"the prompt has {req.prompt_len} tokens, more than the KV cache holds "
                    f"({self.max_total_num_tokens} tokens including at least one generated token)"
                )
        limit = self.server_args.max_queued_requests
        if queue_limit and limit is not None:
            # Beyond the requests the schedulers can run at once, every outstanding one waits in a queue.
            queued = len(self.states) - self.server_args.max_running_requests * self.server_args.dp_size
            if queued + len(reqs) > limit:
                raise ServerBusy(
                    f"{max(queued, 0)} requests are queued and this server queues at most {limit} "
                    "(--max-queued-requests); retry later"
                )
        return reqs

    def _submit(self, reqs: list[TokenizedGenerateReq], with_text: bool) -> list[ReqState]:
        self._check_serving()
        wake = asyncio.Event()
        states = []
        for req in reqs:
            req.return_text_in_logprobs |= with_text
            state = ReqState(req.rid, req.stream, wake, last_time=req.created_time)
            self.states[req.rid] = state
            states.append(state)
            self._dispatcher.submit(req.rid, req, req.data_parallel_rank)
        return states

    async def collect(
        self, reqs: list[TokenizedGenerateReq], with_text: bool = False, client: DisconnectProbe | None = None
    ) -> list[dict[str, Any]]:
        """Run the requests to completion; the final output of each, in order. `with_text`: logprob entries carry
        their token's text even where the requests did not ask for it (return_text_in_logprobs)."""
        states = self._submit(reqs, with_text)
        watch = ClientWatch(client)
        try:
            while not all(s.finished for s in states):
                await self._wait(states[0].wake, watch)
        finally:
            self._abort_unfinished(states)
        return [s.latest for s in states]

    async def stream(
        self, reqs: list[TokenizedGenerateReq], with_text: bool = False, client: DisconnectProbe | None = None
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield (index, newest cumulative output) whenever one of the requests has new output (`with_text`: as for
        collect)."""
        states = self._submit(reqs, with_text)
        watch = ClientWatch(client)
        try:
            live = set(range(len(states)))
            while live:
                await self._wait(states[0].wake, watch)
                for i in sorted(live):
                    state = states[i]
                    if state.latest is not None:
                        out, state.latest = state.latest, None
                        if state.finished:
                            live.discard(i)
                        yield i, out
        finally:
            self._abort_unfinished(states)

    async def _wait(self, wake: asyncio.Event, watch: ClientWatch) -> None:
        """Until `wake` is set, checking on the client whenever a check is due (see ClientWatch)."""
        while True:
            try:
                await asyncio.wait_for(wake.wait(), DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                await watch.check()
                continue
            wake.clear()
            self._check_serving()
            await watch.check()
            return

    def _abort_unfinished(self, states: list[ReqState]) -> None:
        for state in states:
            if not state.finished and self.states.pop(state.rid, None) is not None:
                if self.failure is None:  # a dead scheduler's socket would queue the message, or block
                    self._dispatcher.to_owner(state.rid, AbortRequest(rid=state.rid))
                self._dispatcher.release(state.rid)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort on a user's behalf: the callers still get the aborted output (finish_reason abort)."""
        msg = AbortRequest(rid=rid, abort_all=abort_all)
        if abort_all:
            self._dispatcher.broadcast(msg)
        else:
            self._dispatcher.to_owner(rid, msg)

    async def health_generate(self, timeout: float) -> bool:
        """True once the scheduler answers a one-token request (or anything at all) within `timeout`."""
        tic = time.time()
        obj = GenerateReqInput(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=f"HEALTH_{uuid.uuid4().hex}"
        )
        task = asyncio.create_task(self.collect(self.prepare(obj, queue_limit=False)))
        try:
            while time.time() < tic + timeout and self.failure is None:
                if task.done() or self.last_receive_time > tic:
                    return True
                await asyncio.sleep(0.05)
            return False
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ---- control ------------------------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        results = await self._control(lambda rid: FlushCacheRequest(rid))
        return all(r.success for r in results)

    async def update_weights_from_disk(self, model_path: str, load_format: str | None) -> tuple[bool, str]:
        """Every replica serves the checkpoint once its running requests are done (new ones wait meanwhile)."""
        results = await self._control(lambda rid: UpdateWeightsRequest(rid, model_path, load_format), timeout=None)
        failed = [r.message for r in results if not r.success]
        if failed:
            return False, failed[0]
        self.server_args.model_path = model_path
        return True, results[0].message

    async def profile(self, start: bool, options: dict | None = None) -> tuple[bool, list[str]]:
        """Start or stop every replica's profile; (all succeeded, each replica's trace path or error)."""
        results = await self._control(lambda rid: ProfileRequest(rid, start, options or {}))
        return all(r.success for r in results), [r.message for r in results]

    def concate_and_append(self, src_rids: list[str]) -> None:
        """SGLang's join of forks' KV: the destination's next prompt reuses each fork's statement as a span."""
        if self.parallel_encoding is None:
            raise ValueError("parallel encoding needs the radix cache, page_size 1 and span markers on")
        self.parallel_encoding.expect_join(src_rids)

    async def warm_spans(self, spans: list[str]) -> dict[str, int]:
        """Prefill spans without generating; raises ValueError for bad span text."""
        segments = self.request_builder.span_segments(spans)
        results = await self._control(lambda rid: WarmSpansRequest(rid, segments), timeout=None)
        return {
            "num_spans": results[0].num_spans,
            "span_tokens": results[0].span_tokens,
            "computed_tokens": sum(r.computed_tokens for r in results),  # every replica caches the spans
        }

    async def get_stats(self) -> SchedulerSnapshot:
        return combine_snapshots(await self.get_stats_per_replica())

    async def get_stats_per_replica(self) -> list[SchedulerSnapshot]:
        return [r.snapshot for r in await self._control(lambda rid: StatsRequest(rid))]

    async def _control(self, make: Callable[[str], object], timeout: float | None = CONTROL_TIMEOUT_S) -> list[Any]:
        """Send a control message to every replica; their replies, in replica order."""
        self._check_serving()
        loop = asyncio.get_running_loop()
        request_ids = [uuid.uuid4().hex for _ in range(self._dispatcher.dp_size)]
        futures = []
        for rank, request_id in enumerate(request_ids):
            futures.append(loop.create_future())
            self.pending[request_id] = futures[-1]
            self._dispatcher.send(rank, make(request_id))
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
        finally:
            for request_id in request_ids:
                self.pending.pop(request_id, None)
