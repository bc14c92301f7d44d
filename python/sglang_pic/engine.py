"""The offline engine: SGLang's `Engine` API running the same scheduler in-process (no HTTP, no subprocesses)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import Req
from sglang_pic.managers.scheduler import Scheduler
from sglang_pic.managers.tokenizer_manager import TokenizerManager
from sglang_pic.model_config import ModelConfig
from sglang_pic.model_executor.model_runner import ModelRunner
from sglang_pic.model_loader.loader import resolve_model_path
from sglang_pic.server_args import ServerArgs
from sglang_pic.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model_path=..., **server_args)`; `generate(...)` returns a dict for one prompt, a list for a batch."""

    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        self.server_args = server_args or ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        if args.model_path is None:
            from sglang_pic.model_loader.default_model import default_model_path

            args.model_path = args.tokenizer_path = default_model_path()
        model_dir = resolve_model_path(args.model_path, args.load_format)
        self.model_config = ModelConfig.from_path(
            model_dir, context_length=args.context_length, dtype=args.dtype, device=args.resolved_device()
        )
        self.tokenizer = load_tokenizer(args.tokenizer_path if args.tokenizer_path != args.model_path else model_dir)
        self.runner = ModelRunner(args, self.model_config)
        self.scheduler = Scheduler(args, self.runner, self.tokenizer)
        self.tokenizer_manager = TokenizerManager(args, self.tokenizer, self.model_config)

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        logprob_start_len: int | list[int] = -1,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            stream=stream,
        )
        reqs = self.tokenizer_manager.build_requests(obj)
        if stream:
            return self._stream(reqs, return_text_in_logprobs)
        for req in reqs:
            self.scheduler.add_request(req)
        self._run_until_done(reqs)
        outs = [self.tokenizer_manager.format_output(r, return_text_in_logprobs) for r in reqs]
        return outs if obj.is_batch or len(outs) > 1 else outs[0]

    def _run_until_done(self, reqs: list[Req]) -> None:
        try:
            while not all(r.finished() for r in reqs):
                self.scheduler.step()
        except BaseException:
            for r in reqs:
                if not r.finished():
                    self.scheduler.abort_request(r.rid)
            raise

    def _stream(self, reqs: list[Req], with_text: bool) -> Iterator[dict]:
        """Yield a chunk (cumulative text, like SGLang's native streaming) whenever a request has new output."""
        for req in reqs:
            self.scheduler.add_request(req)
        mine = {r.rid for r in reqs}
        try:
            while not all(r.finished() for r in reqs):
                for req in self.scheduler.step():
                    if req.rid in mine:
                        yield self.tokenizer_manager.format_output(req, with_text)
        finally:
            for r in reqs:
                if not r.finished():
                    self.scheduler.abort_request(r.rid)

    def warm_spans(self, spans: list[str]) -> dict[str, Any]:
        """Prefill spans into the cache without generating (the barrier workflow's first phase)."""
        keyed = self.tokenizer_manager.span_keys(spans)
        before = self.scheduler.stats.computed_prefill_tokens
        jobs = self.scheduler.add_span_jobs(keyed)
        self._run_until_done(jobs)
        return {
            "num_spans": len(spans),
            "span_tokens": sum(len(t) for _, t in keyed),
            "computed_tokens": self.scheduler.stats.computed_prefill_tokens - before,
        }

    # ---- control ------------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_stats(self) -> dict[str, Any]:
        from dataclasses import asdict

        stats = asdict(self.scheduler.stats)
        stats["token_usage"] = self.scheduler.token_usage()
        stats["max_total_num_tokens"] = self.runner.max_total_num_tokens
        return stats

    def shutdown(self) -> None:
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort_request(req.rid)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
