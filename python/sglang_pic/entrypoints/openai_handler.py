"""What the /v1 generation routes share: a body parsed into prepared requests (or the 4xx/503 naming the
problem), and its sampling fields mapped to native params with chat's defaults from the model's generation
config. Each request runs through the same ServerTokenizerManager as /generate, so validation, the context limit,
caching and abort-on-disconnect behave identically; only the wire format and the fields' names differ."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from sglang_pic.entrypoints.errors import error_response
from sglang_pic.entrypoints.openai_output import STREAM_END, StreamCursor, finish_of, usage_of
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, describe_errors
from sglang_pic.entrypoints.openai_responses import UsageInfo
from sglang_pic.entrypoints.request_body import read_object
from sglang_pic.entrypoints.request_log import request_record
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.request_builder import ContextOverflow
from sglang_pic.managers.server_tokenizer_manager import ClientDisconnected, ServerBusy, ServerTokenizerManager

# The model name SGLang's documentation and examples send; it means the served model, as an omitted name does.
DEFAULT_MODEL_ALIAS = "default"
# OpenAI's defaults, used when neither the request nor the model's generation_config.json sets a value.
CHAT_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json (as SGLang's `--sampling-defaults model`)."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {k: config[k] for k in CHAT_SAMPLING_DEFAULTS if k in config}


def refusal(request: Request, exc: ValueError) -> Response:
    """A 400 naming the problem; for pydantic's errors, OpenAI's `param` names the first offending field."""
    if isinstance(exc, ValidationError):
        message, param = describe_errors(exc.errors())
        return error_response(request.url.path, message, 400, param)
    return error_response(request.url.path, str(exc))


def unknown_model(request: Request, manager: ServerTokenizerManager, name: str | None) -> Response | None:
    """OpenAI's and vLLM's 404 for a model this server does not serve, so a client that meant another deployment
    hears so instead of getting this model's answer under that name. Served: the served name, the model path and
    DEFAULT_MODEL_ALIAS; an omitted or empty name means the served model."""
    if not name or name in (manager.served_model_name, manager.server_args.model_path, DEFAULT_MODEL_ALIAS):
        return None
    message = f"The model `{name}` does not exist. This server serves `{manager.served_model_name}`."
    return error_response(request.url.path, message, 404, "model")


class GenerationHandler(ABC):
    """Base of one generation route: subclasses give the body's model and how a body becomes a native input."""

    body_model: type[CompletionRequest] | type[ChatCompletionRequest]
    rid_prefix: str
    prompt_field: str  # the body's field that holds the prompt

    def __init__(self, manager: ServerTokenizerManager) -> None:
        self.manager = manager
        self.tokenizer = manager.tokenizer
        self.defaults = {**CHAT_SAMPLING_DEFAULTS, **generation_defaults(manager.files.model_dir)}

    @abstractmethod
    def to_input(self, body: Any, rid: str) -> GenerateReqInput:
        """The native input for a validated body; ValueError names what it cannot serve."""

    @abstractmethod
    def default_max_tokens(self) -> int:
        """The output limit of a body that gives none, before it is cut to the room its prompt leaves."""

    def limit_field(self, body: Any) -> str:
        """The body's field that holds the output limit."""
        return "max_tokens"

    async def prepare(self, request: Request) -> Any:
        """Parse a body into requests: (body, rid, reqs), or a 400/404/503 response naming the problem."""
        try:
            body = self.body_model.model_validate(await read_object(request))
            refused = unknown_model(request, self.manager, body.model)
            if refused is not None:
                return refused
            rid = body.rid or f"{self.rid_prefix}-{uuid.uuid4().hex}"
            obj = self.to_input(body, rid)
            reqs = self.manager.prepare(obj, default_max_new_tokens=self.default_max_tokens())
            request_record(request).note_prepared(obj, reqs)
            return body, rid, reqs
        except ContextOverflow as e:
            param = self.prompt_field if e.max_new_tokens is None else self.limit_field(body)
            return error_response(request.url.path, e.message(self.limit_field(body)), 400, param)
        except ValueError as e:  # pydantic's ValidationError too
            return refusal(request, e)
        except ServerBusy as e:
            return error_response(request.url.path, str(e), 503)

    async def replies(self, reqs: list, request: Request, stream: AsyncIterator[str] | None) -> list[dict] | Response:
        """The whole outputs of `reqs`, or the response that ends the call instead: `stream` as server-sent events,
        or 499 when the client hung up."""
        if stream is not None:
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            outs = await self.manager.collect(reqs, True, request)
        except ClientDisconnected:
            return Response(status_code=499)
        request_record(request).note_finished(outs)
        return outs

    async def stream_events(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        reqs: list,
        request: Request,
        chunks: Callable[[int, dict, StreamCursor], Iterator[str]],
        usage_chunk: Callable[[UsageInfo], str],
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed call: `chunks` turns each output of choice i (with its cursor) into
        events; then, when the body asks for it, `usage_chunk` of the finished choices, and the end marker. A client
        that hangs up ends the stream without it (the manager aborts the requests)."""
        cursors = [StreamCursor() for _ in reqs]
        finals: dict[int, dict] = {}
        try:
            async with aclosing(self.manager.stream(reqs, True, request)) as outputs:
                async for i, out in outputs:
                    for event in chunks(i, out, cursors[i]):
                        yield event
                    if finish_of(out)[0] is not None:
                        finals[i] = out
            request_record(request).note_finished([finals[i] for i in sorted(finals)])
            if body.stream_options and body.stream_options.include_usage:
                yield usage_chunk(usage_of([finals[i] for i in sorted(finals)], body.n))
        except ClientDisconnected:
            return
        yield STREAM_END

    def sampling(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> dict:
        """Native sampling params; chat fields left unset fall back to the model's generation config."""

        def pick(name: str) -> Any:
            value = getattr(body, name)
            return self.defaults[name] if value is None else value

        return {
            "max_new_tokens": max_tokens,
            "min_new_tokens": body.min_tokens,
            "temperature": pick("temperature"),
            "top_p": pick("top_p"),
            "top_k": pick("top_k"),
            "min_p": pick("min_p"),
            "repetition_penalty": pick("repetition_penalty"),
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "stop": body.stop,
            "stop_token_ids": body.stop_token_ids,
            "no_stop_trim": body.no_stop_trim,
            "ignore_eos": body.ignore_eos,
            "skip_special_tokens": body.skip_special_tokens,
            "n": body.n,
            "seed": body.seed,
            "logit_bias": body.logit_bias,
            "regex": body.regex,
            "ebnf": body.ebnf,
            "json_schema": body.json_schema,
            "stop_regex": body.stop_regex,
        }
