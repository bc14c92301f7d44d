"""The offline engine: SGLang's `Engine` API running the same scheduler in-process (no HTTP, no subprocesses)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from sglang_pic.distributed.launch import FOLLOWER_STOP_S
from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq
from sglang_pic.managers.output_format import OutputFormatter, Reporter, RequestOutputs, output_of
from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.managers.request_builder import RequestBuilder
from sglang_pic.managers.scheduler import Scheduler
from sglang_pic.model_config import ModelConfig
from sglang_pic.model_executor.local_replica import LocalReplica
from sglang_pic.model_executor.model_runner import ModelRunner
from sglang_pic.model_loader.loader import resolve_model_path
from sglang_pic.server_args import ServerArgs
from sglang_pic.speculative.algorithms import draft_memory, spec_worker_factory
from sglang_pic.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Concurrent async_generate calls in flight at once; more wait for a worker (their requests join the batch then).
ASYNC_WORKERS = 256
# How long a failed step waits to see whether a tensor-parallel follower died (then the error names it).
FOLLOWER_EXIT_WAIT_S = 2.0


class Engine:
    """`Engine(model_path=..., **server_args)`; `generate(...)` returns a dict for one prompt, a list for a batch.

    Thread-safe: concurrent callers (e.g. SGLang programs running forks in threads) share one scheduler; whoever
    waits drives it one step at a time under a lock, so their requests are batched together.

    Requests take the server's path without its processes: the RequestBuilder's wire messages become the
    scheduler's Reqs (Req.from_wire), and their reports are formatted by output_format, as the detokenizer does.

    With tp_size > 1 this process is tensor-parallel rank 0 and spawns ranks 1..tp_size-1 (torch.multiprocessing,
    so the calling script needs the usual `if __name__ == "__main__":` guard); `shutdown()` stops them. A follower
    that dies makes the constructor, or every call from then on, raise RuntimeError naming it.
    """

    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        self.server_args = server_args or ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        if args.dp_size > 1:
            raise ValueError("dp_size > 1 is served by launch_server; the offline Engine runs one model replica")
        if args.model_path is None:
            from sglang_pic.model_loader.default_model import use_default_model

            use_default_model(args)
        model_dir = resolve_model_path(args.model_path, args.load_format)
        self.model_config = ModelConfig.from_server_args(model_dir, args)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(
                args.tokenizer_path if args.tokenizer_path != args.model_path else model_dir
            )
        self._replica = LocalReplica.start(args, model_dir) if args.tp_size > 1 else None
        try:
            self.runner = ModelRunner(args, self.model_config, draft_memory(args))
            self.scheduler = Scheduler(args, self.runner, self.tokenizer, spec_worker_factory(args))
        except BaseException as e:
            failure = self._follower_failure(e)
            self._stop_tensor_parallel(timeout=0)
            if failure is not None:
                raise RuntimeError(failure) from e
            raise
        self.request_builder = RequestBuilder(args, self.tokenizer, self.model_config)
        self.formatter = OutputFormatter(self.tokenizer)
        self._lock = threading.Lock()
        self._incoming: deque[Req] = deque()  # submitted, not yet in the scheduler
        # async_generate's callers wait here, one thread each; waiting threads only take the lock to step.
        self._async_workers = ThreadPoolExecutor(max_workers=ASYNC_WORKERS, thread_name_prefix="engine-async")

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        logprob_start_len: int | list[int] = -1,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool = False,
        priority: int | list[int | None] | None = None,
        span_anchor: str | list[str | None] | None = None,
        span_head_tokens: int | list[int | None] | None = None,
        span_tail_tokens: int | list[int | None] | None = None,
        span_query_share: float | list[float | None] | None = None,
        span_select: str | list[str | None] | None = None,
        span_attention_temperature: float | list[float | None] | None = None,
        span_attention_scale: float | list[float | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's Engine.generate; the span_* arguments override the server's span quality settings for these
        prompts (span_policy.py)."""
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs,
            stream=stream,
            priority=priority,
            span_anchor=span_anchor,
            span_head_tokens=span_head_tokens,
            span_tail_tokens=span_tail_tokens,
            span_query_share=span_query_share,
            span_select=span_select,
            span_attention_temperature=span_attention_temperature,
            span_attention_scale=span_attention_scale,
        )
        msgs = self.request_builder.build(obj)
        if stream:
            return self._stream(msgs)
        reqs = self._submit(msgs)
        self._run_until_done(reqs)
        outs = [output_of(self.formatter, msg, req) for msg, req in zip(msgs, reqs)]
        return outs if obj.is_batch or len(outs) > 1 else outs[0]

    def make_reqs(self, obj: GenerateReqInput) -> list[Req]:
        """The scheduler's requests for `obj`, built as generate builds them, for callers that drive
        `engine.scheduler` themselves (tests, benchmarks)."""
        return [Req.from_wire(msg) for msg in self.request_builder.build(obj)]

    async def async_generate(self, *args: Any, **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate(...)` for asyncio code, as in SGLang. Each call waits in a worker thread, so the event loop never
        blocks on a step and concurrent calls share the scheduler, their requests batched together. With
        stream=True it returns an async iterator of the same cumulative chunks; closing it early aborts the rest."""
        call = partial(self.generate, *args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(self._async_workers, call)
        return self._async_stream(result) if isinstance(result, Iterator) else result

    async def _async_stream(self, chunks: Iterator[dict]) -> AsyncIterator[dict]:
        loop, end = asyncio.get_running_loop(), object()
        try:
            while (chunk := await loop.run_in_executor(self._async_workers, next, chunks, end)) is not end:
                yield chunk
        finally:
            await loop.run_in_executor(self._async_workers, chunks.close)

    def _submit(self, msgs: list[TokenizedGenerateReq]) -> list[Req]:
        """Queue requests for the next step. Never waits for the lock: a thread stepping in a loop can take it back
        at once (locks are not fair), which would keep other callers' requests out of its batches."""
        self._live()
        reqs = [Req.from_wire(msg) for msg in msgs]
        self._incoming.extend(reqs)
        return reqs

    def _live(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("the engine is shut down")
        if self._replica is not None:
            self._replica.check()
        return self.scheduler

    def _follower_failure(self, error: BaseException) -> str | None:
        """Why a tensor-parallel follower died, if one did and could have caused `error`: a collective reports a
        lost peer as a RuntimeError. Any other error (a ValueError about the arguments) is this process's own."""
        if self._replica is None or not isinstance(error, RuntimeError):
            return None
        return self._replica.failure(FOLLOWER_EXIT_WAIT_S)

    def _admit(self) -> None:
        """Hand queued requests to the scheduler (under the lock)."""
        while self._incoming:
            self.scheduler.add_request(self._incoming.popleft())

    def _step(self) -> list[Req]:
        with self._lock:
            scheduler = self._live()  # a thread may still be stepping when another shuts the engine down
            self._admit()
            try:
                return scheduler.step()
            except Exception as e:
                failure = self._follower_failure(e)
                if failure is not None:
                    raise RuntimeError(failure) from e
                raise

    def _abort_unfinished(self, reqs: list[Req]) -> None:
        with self._lock:
            self._admit()
            for r in reqs:
                if not r.finished():
                    self.scheduler.abort_request(r.rid)

    def _run_until_done(self, reqs: list[Req]) -> None:
        try:
            while not all(r.finished() for r in reqs):
                self._step()
        except BaseException:
            self._abort_unfinished(reqs)
            raise

    def _stream(self, msgs: list[TokenizedGenerateReq]) -> Iterator[dict]:
        """Yield a chunk (cumulative text, like SGLang's native streaming) whenever a request reports."""
        reqs = self._submit(msgs)
        reporter, outputs = Reporter(self.server_args.stream_interval), RequestOutputs(self.formatter)
        for msg in msgs:
            reporter.add(msg)
        try:
            while not all(r.finished() for r in reqs):
                self._step()
                for delta in reporter.deltas(reqs):
                    yield outputs.apply(delta)
        finally:
            self._abort_unfinished(reqs)

    def generate_request(self, body: dict[str, Any]) -> dict | list[dict] | Iterator[dict]:
        """Serve a `/generate` JSON body (SGLang's field names) in-process."""
        obj = GenerateReqInput.from_json(body)
        if obj.data_parallel_rank not in (None, 0):
            raise ValueError(f"the offline Engine has one replica; data_parallel_rank {obj.data_parallel_rank!r}")
        return self.generate(
            prompt=obj.text,
            sampling_params=obj.sampling_params,
            input_ids=obj.input_ids,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num,
            logprob_start_len=obj.logprob_start_len,
            stream=obj.stream,
            rid=obj.rid,
            return_text_in_logprobs=obj.return_text_in_logprobs,
            token_ids_logprob=obj.token_ids_logprob,
            priority=obj.priority,
            span_anchor=obj.span_anchor,
            span_head_tokens=obj.span_head_tokens,
            span_tail_tokens=obj.span_tail_tokens,
            span_query_share=obj.span_query_share,
            span_select=obj.span_select,
            span_attention_temperature=obj.span_attention_temperature,
            span_attention_scale=obj.span_attention_scale,
        )

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.server_args.model_path,
            "tokenizer_path": self.server_args.tokenizer_path,
            "is_generation": True,
        }

    def get_server_info(self) -> dict[str, Any]:
        return {**self.server_args.resolved(), **self.get_stats()}

    def warm_spans(self, spans: list[str]) -> dict[str, Any]:
        """Prefill spans into the cache without generating (the barrier workflow's first phase)."""
        segments = self.request_builder.span_segments(spans)
        before = self._live().stats.computed_prefill_tokens
        with self._lock:
            jobs = self.scheduler.add_span_jobs([ReqSegment.from_wire(seg) for seg in segments])
        self._run_until_done(jobs)
        return {
            "num_spans": len(spans),
            "span_tokens": sum(len(seg.tokens) for seg in segments),
            "computed_tokens": self.scheduler.stats.computed_prefill_tokens - before,
        }

    # ---- control ------------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        with self._lock:
            return self._live().flush_cache()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str]:
        """SGLang's: load another checkpoint of the served model (same architecture and shapes) in place and drop
        the prefix/span cache. Returns (success, message); refused while requests run."""
        with self._lock:
            scheduler = self._live()
            self._admit()
            try:
                message = scheduler.update_weights_from_disk(model_path, load_format)
            except ValueError as e:
                return False, str(e)
        self.server_args.model_path = model_path
        return True, message

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        record_shapes: bool = False,
    ) -> str:
        """SGLang's: record torch.profiler over the coming steps (all until stop_profile, or `num_steps`); returns
        the Chrome trace's path (in output_dir, else $SGLANG_TORCH_PROFILER_DIR or /tmp). activities: "CPU",
        "GPU". ValueError names a bad argument."""
        with self._lock:
            return self._live().profiler.start(output_dir, num_steps, activities, record_shapes)

    def stop_profile(self) -> str:
        """Stop the profile and write its trace; returns the path. ValueError when none is running."""
        with self._lock:
            return self._live().profiler.stop()

    def get_stats(self) -> dict[str, Any]:
        """Counters and cache state; after shutdown, those it ended with."""
        from dataclasses import asdict

        if self.scheduler is None:
            return dict(self._final_stats)
        stats = asdict(self.scheduler.stats)
        stats["span_hit_rate"] = stats["span_segment_hits"] / max(stats["span_segments"], 1)
        stats["reused_prefill_tokens"] = stats["cached_prefix_tokens"] + stats["cached_span_tokens"]
        stats["token_usage"] = self.scheduler.token_usage()
        tree = self.scheduler.tree
        stats["hicache_host_tokens"] = tree.host_size()
        stats["hicache_backed_up_tokens"] = tree.backed_up_tokens
        stats["hicache_loaded_tokens"] = tree.loaded_tokens
        if self.scheduler.spec_worker is not None:
            stats["spec"] = self.scheduler.spec_worker.stats.to_dict()
        stats["max_total_num_tokens"] = self.runner.max_total_num_tokens
        return stats

    def shutdown(self) -> None:
        """Abort what is unfinished and free the weights, KV pools and graphs, so that another engine in this
        process gets the device memory (SGLang frees it by ending its scheduler process); the engine keeps only
        its final stats."""
        if self.scheduler is None:
            return
        with self._lock:
            self._admit()
        self._abort_unfinished(list(self.scheduler.waiting) + list(self.scheduler.running))
        self._async_workers.shutdown(wait=False)
        if self._replica is not None:
            with self._lock:
                if self._replica.failure() is None:  # a dead follower hears nothing; the others are terminated
                    self.runner.shutdown()
            self._stop_tensor_parallel()
        self._final_stats = self.get_stats()
        with self._lock:
            if self.scheduler.trace is not None:
                self.scheduler.trace.close()
            self.scheduler = self.runner = None
        gc.collect()  # the model and captured graphs hold reference cycles
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _stop_tensor_parallel(self, timeout: float = FOLLOWER_STOP_S) -> None:
        if self._replica is not None:
            self._replica.stop(timeout)
            self._replica = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
