"""/v1/completions: a prompt (text or ids, one or a batch) continued, answered whole or as a stream of text deltas
with OpenAI's legacy logprobs; `echo` puts each prompt before its choices."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response

from sglang_pic.entrypoints.openai_handler import GenerationHandler
from sglang_pic.entrypoints.openai_output import (
    StreamCursor,
    completion_logprobs,
    finish_of,
    sse,
    usage_of,
)
from sglang_pic.entrypoints.openai_protocol import CompletionRequest
from sglang_pic.entrypoints.openai_responses import CompletionChoice, CompletionResponse, UsageInfo
from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq

# OpenAI's max_tokens for completions when the body gives none.
DEFAULT_MAX_TOKENS = 16


class CompletionsHandler(GenerationHandler):
    body_model = CompletionRequest
    rid_prefix = "cmpl"
    prompt_field = "prompt"

    async def handle(self, request: Request) -> Response:
        parsed = await self.prepare(request)
        if isinstance(parsed, Response):
            return parsed
        body, rid, reqs = parsed
        model = self.manager.served_model_name
        echoes = self._echo_texts(body) if body.echo else None
        stream = self._stream(body, reqs, rid, model, echoes, request) if body.stream else None
        outs = await self.replies(reqs, request, stream)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            logprobs = None
            if body.logprobs is not None:
                triples = (meta["input_token_logprobs"] if echoes else []) + meta["output_token_logprobs"]
                tops = (meta["input_top_logprobs"] if echoes else []) + meta["output_top_logprobs"]
                logprobs, _ = completion_logprobs(triples, tops, 0)
            reason, matched = finish_of(out)
            text = (echoes[i // body.n] if echoes else "") + out["text"]
            choices.append(
                CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
            )
        response = CompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outs, body.n))
        return Response(response.model_dump_json(), media_type="application/json")

    def default_max_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS

    def to_input(self, body: CompletionRequest, rid: str) -> GenerateReqInput:
        if body.best_of is not None and body.best_of != body.n:
            raise ValueError("best_of is not supported (it may only equal n)")
        if body.suffix:
            raise ValueError("suffix is not supported")
        prompt = body.prompt
        single = isinstance(prompt, str) or isinstance(prompt[0], int)
        is_text = isinstance(prompt, str) or isinstance(prompt[0], str)
        with_logprobs = body.logprobs is not None
        return GenerateReqInput(
            text=prompt if is_text else None,
            input_ids=None if is_text else prompt,
            sampling_params=self.sampling(body, body.max_tokens),
            rid=rid if single else [f"{rid}-{i}" for i in range(len(prompt))],
            return_logprob=with_logprobs,
            logprob_start_len=0 if body.echo and with_logprobs else -1,
            top_logprobs_num=body.logprobs or 0,
            return_text_in_logprobs=True,
            stream=body.stream,
            priority=body.priority,
            data_parallel_rank=body.data_parallel_rank,
            **body.span_settings(),
        )

    def _echo_texts(self, body: CompletionRequest) -> list[str]:
        """The prompt text of each prompt, which `echo` puts before its choices' text."""
        prompt = body.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [self.tokenizer.decode(prompt, skip_special_tokens=True)]
        if isinstance(prompt[0], str):
            return list(prompt)
        return [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompt]

    def _stream(
        self,
        body: CompletionRequest,
        reqs: list[TokenizedGenerateReq],
        rid: str,
        model: str,
        echoes: list[str] | None,
        request: Request,
    ) -> AsyncIterator[str]:
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        def chunks(i: int, out: dict, cursor: StreamCursor) -> Iterator[str]:
            delta, triples, tops = cursor.advance(out)
            if echoes and not cursor.started:
                delta = echoes[i // body.n] + delta
                triples = out["meta_info"].get("input_token_logprobs", []) + triples
                tops = out["meta_info"].get("input_top_logprobs", []) + tops
            cursor.started = True
            logprobs = None
            if body.logprobs is not None and triples:
                logprobs, cursor.offset = completion_logprobs(triples, tops, cursor.offset)
            reason, matched = finish_of(out)
            if delta or logprobs or reason:
                choice = CompletionChoice(
                    index=i, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
                )
                usage = usage_of([out], 1) if continuous else None
                yield sse(CompletionResponse(id=rid, model=model, choices=[choice], usage=usage))

        def usage_chunk(usage: UsageInfo) -> str:
            return sse(CompletionResponse(id=rid, model=model, choices=[], usage=usage), exclude_none=True)

        return self.stream_events(body, reqs, request, chunks, usage_chunk)
