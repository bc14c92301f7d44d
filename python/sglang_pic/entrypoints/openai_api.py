"""The OpenAI-compatible API: /v1/models, /v1/completions and /v1/chat/completions, streaming or not.

Each request is translated into a native `GenerateReqInput` and run through the same ServerTokenizerManager as
/generate, so validation, caching and abort-on-disconnect behave identically; only the wire format differs.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from sglang_pic.entrypoints.openai_protocol import (
    CalledFunction,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    ToolCallItem,
    ToolSpanSettings,
    TopLogprob,
    UsageInfo,
    describe_errors,
)
from sglang_pic.entrypoints.chat_reply import ChatReplyReader
from sglang_pic.entrypoints.errors import error_response
from sglang_pic.entrypoints.reasoning import REASONING_PARSERS, ReasoningStream
from sglang_pic.entrypoints.tool_calls import (
    CallDelta,
    ToolCallStream,
    mark_tool_spans,
    tool_call_parser,
)
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import Req
from sglang_pic.managers.server_tokenizer_manager import (
    ClientDisconnected,
    ServerBusy,
    ServerTokenizerManager,
)
from sglang_pic.sampling.sampling_params import GRAMMAR_FIELDS
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import format_settings

logger = logging.getLogger(__name__)

# Jinja chat templates selectable by name with --chat-template (otherwise a file path, else the tokenizer's own).
BUILTIN_CHAT_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama-3-instruct": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}

# OpenAI's defaults, used when neither the request nor the model's generation_config.json sets a value.
CHAT_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def load_chat_template(spec: str | None, tokenizer) -> str | None:
    """The Jinja template for chat: a built-in name, a file (Jinja text, or JSON with `chat_template`), or the
    tokenizer's own when `spec` is None. Raise ValueError for a name that is neither."""
    if spec is None:
        return getattr(tokenizer, "chat_template", None)
    if spec in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--chat-template {spec!r} is neither a file nor a built-in template ({', '.join(BUILTIN_CHAT_TEMPLATES)})"
        )
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)["chat_template"]
    return text


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json (as SGLang's `--sampling-defaults model`)."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {k: config[k] for k in CHAT_SAMPLING_DEFAULTS if k in config}


def _refusal(request: Request, exc: ValueError) -> Response:
    """A 400 naming the problem; for pydantic's errors, OpenAI's `param` names the first offending field."""
    if isinstance(exc, ValidationError):
        message, param = describe_errors(exc.errors())
        return error_response(request.url.path, message, 400, param)
    return error_response(request.url.path, str(exc))


def _sse(model: BaseModel, exclude_none: bool = False) -> str:
    return f"data: {model.model_dump_json(exclude_none=exclude_none)}\n\n"


def _finish(out: dict[str, Any]) -> tuple[str | None, int | str | None]:
    reason = out["meta_info"]["finish_reason"]
    return (reason["type"], reason.get("matched")) if reason else (None, None)


# Enough of a prompt's last tokens to see whether the chat template opened the reply's thinking.
_PROMPT_END_TOKENS = 16


def _tool_items(calls: list[CallDelta]) -> list[ToolCallItem] | None:
    """Calls as the API returns them (each with its index, which stream deltas need and messages tolerate)."""
    if not calls:
        return None
    return [
        ToolCallItem(
            index=c.index,
            id=c.id,
            type="function" if c.id is not None else None,
            function=CalledFunction(name=c.name, arguments=c.arguments),
        )
        for c in calls
    ]


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: earlier calls with their arguments as objects (templates render
    them with tojson), a tool message with the call it answers."""
    entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        entry["name"] = m.name
    if m.tool_call_id is not None:
        entry["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        entry["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _json_args(c.function)}}
            for c in m.tool_calls
        ]
    return entry


def _json_args(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


def _usage(outs: list[dict[str, Any]], n: int) -> UsageInfo:
    """Prompt tokens (and their cache hits) count once per prompt, not once per sampled choice."""
    firsts = [out["meta_info"] for out in outs[::n]]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(out["meta_info"]["completion_tokens"] for out in outs)
    cached = sum(m["cached_tokens"] for m in firsts)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _completion_logprobs(triples: list, tops: list, offset: int) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy logprobs object from (logprob, id, text) triples; returns the next text offset too."""
    lp = CompletionLogProbs()
    for (value, _, text), top in zip(triples, tops or [None] * len(triples)):
        lp.tokens.append(text)
        lp.token_logprobs.append(value)
        lp.text_offset.append(offset)
        offset += len(text)
        lp.top_logprobs.append({t[2]: t[0] for t in top} if top else None)
    return lp, offset


def _chat_logprobs(triples: list, tops: list) -> ChatChoiceLogprobs:
    content = []
    for (value, _, text), top in zip(triples, tops or [None] * len(triples)):
        content.append(
            ChatTokenLogprob(
                token=text,
                bytes=list(text.encode()),
                logprob=value,
                top_logprobs=[TopLogprob(token=t[2], bytes=list(t[2].encode()), logprob=t[0]) for t in top or []],
            )
        )
    return ChatChoiceLogprobs(content=content)


@dataclass
class _Cursor:
    """How much of one choice's cumulative output a stream has sent: outputs repeat everything so far."""

    text: str = ""
    logprobs: int = 0
    offset: int = 0  # characters before the next token, for completions' text_offset
    started: bool = False

    def advance(self, out: dict[str, Any]) -> tuple[str, list, list]:
        """The new text and the new (logprob triples, top rows) since the last call."""
        meta = out["meta_info"]
        delta = out["text"][len(self.text) :]
        triples = meta.get("output_token_logprobs", [])[self.logprobs :]
        tops = meta.get("output_top_logprobs", [])[self.logprobs :]
        self.text = out["text"]
        self.logprobs += len(triples)
        return delta, triples, tops


def render_chat(body: ChatCompletionRequest, tokenizer, chat_template: str | None, args: ServerArgs) -> str:
    """The prompt text, kept as text (not ids) so PIC markers inside messages still split it into segments;
    a function of its inputs, so offline tools (sglang_pic.span_quality) render chats as the server does."""
    if chat_template is None:
        raise ValueError("the model has no chat template; start the server with --chat-template")
    messages = [_template_message(m) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.uses_tools() else None
    continue_final = body.continue_final_message and body.messages[-1].role == "assistant"
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as e:  # a Jinja error raised by the template for these messages
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]:
        text = text[len(bos) :]  # the tokenizer adds it again
    if tools and body.tool_spans:
        ssep = args.ssep_marker
        if isinstance(body.tool_spans, ToolSpanSettings):
            own = body.tool_spans
            ssep += args.span_settings_marker + format_settings(own.span_anchor, own.span_head_tokens)
        text = mark_tool_spans(text, tools, ssep, args.pdep_marker)
    return text


class OpenAIServing:
    def __init__(self, manager: ServerTokenizerManager) -> None:
        self.manager = manager
        self.tokenizer = manager.tokenizer
        self.chat_template = load_chat_template(manager.server_args.chat_template, self.tokenizer)
        self.tool_parser = tool_call_parser(manager.server_args.tool_call_parser, manager.model_config.architecture)
        self.reasoning = REASONING_PARSERS.get(manager.server_args.reasoning_parser)
        self.defaults = {**CHAT_SAMPLING_DEFAULTS, **generation_defaults(manager.files.model_dir)}

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        for path in ("/tokenize", "/v1/tokenize"):
            router.add_api_route(path, self.tokenize, methods=["POST"])
        for path in ("/detokenize", "/v1/detokenize"):
            router.add_api_route(path, self.detokenize, methods=["POST"])
        return router

    async def models(self) -> Response:
        card = ModelCard(
            id=self.manager.served_model_name,
            root=self.manager.served_model_name,
            max_model_len=self.manager.context_len,
        )
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    async def tokenize(self, request: Request) -> Response:
        """The ids /generate runs for each prompt (or /v1/chat/completions for chat messages) and, as PIC sees
        them, its segments (prefix, span, pdep) with their lengths: what a client counts before sending, and how
        its markers cut the prompt."""
        try:
            body = TokenizeRequest.model_validate_json(await request.body())
            single = body.messages is not None or isinstance(body.prompt, str)
            if body.messages is not None:
                prompts = [self.render_chat(body.chat())]
            else:
                prompts = [body.prompt] if single else body.prompt
            cut = [self.manager.tokenizer_manager.tokenize(p, body.add_special_tokens) for p in prompts]
        except ValueError as e:  # pydantic's ValidationError too
            return _refusal(request, e)
        tokens = [[t for seg in segments for t in seg.token_ids] for segments in cut]
        parts = [[{"kind": seg.kind, "count": len(seg.token_ids)} for seg in segments] for segments in cut]

        def one_or_all(values: list) -> Any:
            return values[0] if single else values

        content = {
            "tokens": one_or_all(tokens),
            "count": one_or_all([len(t) for t in tokens]),
            "max_model_len": self.manager.context_len,
            "segments": one_or_all(parts),
        }
        return Response(json.dumps(content), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        try:
            body = DetokenizeRequest.model_validate_json(await request.body())
            single = not body.tokens or isinstance(body.tokens[0], int)
            texts = [
                self.manager.tokenizer_manager.detokenize(ids, body.skip_special_tokens)
                for ids in ([body.tokens] if single else body.tokens)
            ]
        except ValueError as e:  # pydantic's ValidationError too
            return _refusal(request, e)
        return Response(json.dumps({"text": texts[0] if single else texts}), media_type="application/json")

    async def _prepare(self, request: Request, model: Any, to_input: Any, rid_prefix: str) -> Any:
        """Parse a body into requests: (body, rid, reqs), or a 400 response naming the problem."""
        try:
            body = model.model_validate_json(await request.body())
            rid = body.rid or f"{rid_prefix}-{uuid.uuid4().hex}"
            return body, rid, self.manager.prepare(to_input(body, rid))
        except ValueError as e:  # pydantic's ValidationError too
            return _refusal(request, e)
        except ServerBusy as e:
            return error_response(request.url.path, str(e), 503)

    # ---- completions --------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        parsed = await self._prepare(request, CompletionRequest, self._completion_input, "cmpl")
        if isinstance(parsed, Response):
            return parsed
        body, rid, reqs = parsed
        model = body.model or self.manager.served_model_name
        echoes = self._echo_texts(body) if body.echo else None
        if body.stream:
            stream = self._completion_stream(body, reqs, rid, model, echoes, request)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            outs = await self.manager.collect(reqs, True, request)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            logprobs = None
            if body.logprobs is not None:
                triples = (meta["input_token_logprobs"] if echoes else []) + meta["output_token_logprobs"]
                tops = (meta["input_top_logprobs"] if echoes else []) + meta["output_top_logprobs"]
                logprobs, _ = _completion_logprobs(triples, tops, 0)
            reason, matched = _finish(out)
            text = (echoes[i // body.n] if echoes else "") + out["text"]
            choices.append(
                CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
            )
        response = CompletionResponse(id=rid, model=model, choices=choices, usage=_usage(outs, body.n))
        return Response(response.model_dump_json(), media_type="application/json")

    def _completion_input(self, body: CompletionRequest, rid: str) -> GenerateReqInput:
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
            sampling_params=self._sampling(body, body.max_tokens),
            rid=rid if single else [f"{rid}-{i}" for i in range(len(prompt))],
            return_logprob=with_logprobs,
            logprob_start_len=0 if body.echo and with_logprobs else -1,
            top_logprobs_num=body.logprobs or 0,
            return_text_in_logprobs=True,
            stream=body.stream,
            priority=body.priority,
            data_parallel_rank=body.data_parallel_rank,
            span_anchor=body.span_anchor,
            span_head_tokens=body.span_head_tokens,
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

    async def _completion_stream(
        self,
        body: CompletionRequest,
        reqs: list[Req],
        rid: str,
        model: str,
        echoes: list[str] | None,
        request: Request,
    ) -> AsyncIterator[str]:
        cursors = [_Cursor() for _ in reqs]
        finals: dict[int, dict] = {}
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        try:
            async with aclosing(self.manager.stream(reqs, True, request)) as outputs:
                async for i, out in outputs:
                    cursor = cursors[i]
                    delta, triples, tops = cursor.advance(out)
                    if echoes and not cursor.started:
                        delta = echoes[i // body.n] + delta
                        triples = out["meta_info"].get("input_token_logprobs", []) + triples
                        tops = out["meta_info"].get("input_top_logprobs", []) + tops
                    cursor.started = True
                    logprobs = None
                    if body.logprobs is not None and triples:
                        logprobs, cursor.offset = _completion_logprobs(triples, tops, cursor.offset)
                    reason, matched = _finish(out)
                    if reason is not None:
                        finals[i] = out
                    if delta or logprobs or reason:
                        choice = CompletionChoice(
                            index=i, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
                        )
                        usage = _usage([out], 1) if continuous else None
                        yield _sse(CompletionResponse(id=rid, model=model, choices=[choice], usage=usage))
            if body.stream_options and body.stream_options.include_usage:
                usage = _usage([finals[i] for i in sorted(finals)], body.n)
                yield _sse(CompletionResponse(id=rid, model=model, choices=[], usage=usage), exclude_none=True)
        except ClientDisconnected:
            return
        yield "data: [DONE]\n\n"

    # ---- chat ---------------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        parsed = await self._prepare(request, ChatCompletionRequest, self._chat_input, "chatcmpl")
        if isinstance(parsed, Response):
            return parsed
        body, rid, reqs = parsed
        if body.max_completion_tokens is None and body.max_tokens is None:
            for req in reqs:  # OpenAI's default: as many tokens as the context has room for
                req.sampling_params.max_new_tokens = max(self.manager.context_len - req.prompt_len, 1)
        model = body.model or self.manager.served_model_name
        if body.stream:
            stream = self._chat_stream(body, reqs, rid, model, request)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            outs = await self.manager.collect(reqs, True, request)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            logprobs = None
            if body.logprobs:
                logprobs = _chat_logprobs(meta["output_token_logprobs"], meta["output_top_logprobs"])
            reason, matched = _finish(out)
            reader = self._reply_reader(body, reqs[i])
            reply = reader.read(out["text"], last=True)
            content, calls = reply.content, []
            if reader.tools is not None:
                content, calls = content.strip(), reader.tools.whole_calls()
            message = ChatResponseMessage(
                role="assistant",
                content=content or None,
                reasoning_content=reply.reasoning or None,
                tool_calls=_tool_items(calls),
            )
            if reader.called:
                reason, matched = "tool_calls", None
            choices.append(
                ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
            )
        response = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage(outs, body.n))
        return Response(response.model_dump_json(), media_type="application/json")

    def _reply_reader(self, body: ChatCompletionRequest, req: Req) -> ChatReplyReader:
        reasoning = None
        if self.reasoning is not None and body.separate_reasoning:
            reasoning = ReasoningStream(self.reasoning, self.tokenizer.decode(req.prompt_ids()[-_PROMPT_END_TOKENS:]))
        tools = None
        if body.uses_tools():
            names = {t.function.name for t in body.tools}
            tools = ToolCallStream(self.tool_parser, names, body.parallel_tool_calls, body.forced_tools() is not None)
        return ChatReplyReader(reasoning, tools)

    def _chat_input(self, body: ChatCompletionRequest, rid: str) -> GenerateReqInput:
        sampling = self._sampling(body, body.max_completion_tokens or body.max_tokens)
        constraints = [name for name in GRAMMAR_FIELDS if sampling.get(name)]
        schema = body.response_format.schema_text() if body.response_format is not None else None
        if schema is not None:
            constraints.append("response_format")
            sampling["json_schema"] = schema
        if body.uses_tools():
            if self.tool_parser is None:
                raise ValueError(
                    f"no tool-call parser for {self.manager.model_config.architecture}; start the server with "
                    "--tool-call-parser"
                )
            sampling["skip_special_tokens"] = False  # call tags (Qwen's <tool_call>) may be special tokens
            forced = body.forced_tools()
            if forced is not None:
                functions = [t.function.model_dump(exclude_none=True) for t in forced]
                constraints.append("tool_choice")
                sampling["json_schema"] = json.dumps(self.tool_parser.forced_call_schema(functions))
        if len(constraints) > 1:
            raise ValueError(f"only one output constraint may be given, got {', '.join(constraints)}")
        return GenerateReqInput(
            text=self.render_chat(body),
            sampling_params=sampling,
            rid=rid,
            return_logprob=body.logprobs,
            top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0,
            return_text_in_logprobs=True,
            stream=body.stream,
            priority=body.priority,
            data_parallel_rank=body.data_parallel_rank,
            span_anchor=body.span_anchor,
            span_head_tokens=body.span_head_tokens,
        )

    def render_chat(self, body: ChatCompletionRequest) -> str:
        return render_chat(body, self.tokenizer, self.chat_template, self.manager.server_args)

    async def _chat_stream(
        self, body: ChatCompletionRequest, reqs: list[Req], rid: str, model: str, request: Request
    ) -> AsyncIterator[str]:
        cursors = [_Cursor() for _ in reqs]
        finals: dict[int, dict] = {}
        readers = [self._reply_reader(body, req) for req in reqs]
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        def chunk(choice: ChatStreamChoice, out: dict) -> str:
            usage = _usage([out], 1) if continuous else None
            return _sse(ChatCompletionChunk(id=rid, model=model, choices=[choice], usage=usage))

        try:
            async with aclosing(self.manager.stream(reqs, True, request)) as outputs:
                async for i, out in outputs:
                    cursor = cursors[i]
                    if not cursor.started:
                        cursor.started = True
                        opening = ChatStreamChoice(index=i, delta=ChatResponseMessage(role="assistant", content=""))
                        yield chunk(opening, out)
                    delta, triples, tops = cursor.advance(out)
                    reason, matched = _finish(out)
                    piece = readers[i].read(delta, last=reason is not None)
                    logprobs = _chat_logprobs(triples, tops) if body.logprobs and triples else None
                    if piece.reasoning:
                        thought = ChatResponseMessage(reasoning_content=piece.reasoning)
                        yield chunk(ChatStreamChoice(index=i, delta=thought), out)
                    if piece.content or logprobs:
                        message = ChatResponseMessage(content=piece.content)
                        yield chunk(ChatStreamChoice(index=i, delta=message, logprobs=logprobs), out)
                    if piece.calls:
                        message = ChatResponseMessage(tool_calls=_tool_items(piece.calls))
                        yield chunk(ChatStreamChoice(index=i, delta=message), out)
                    if reason is not None and readers[i].called:
                        reason, matched = "tool_calls", None
                    if reason is not None:
                        finals[i] = out
                        closing = ChatStreamChoice(
                            index=i, delta=ChatResponseMessage(), finish_reason=reason, matched_stop=matched
                        )
                        yield chunk(closing, out)
            if body.stream_options and body.stream_options.include_usage:
                usage = _usage([finals[i] for i in sorted(finals)], body.n)
                yield _sse(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage), exclude_none=True)
        except ClientDisconnected:
            return
        yield "data: [DONE]\n\n"

    # ---- shared -------------------------------------------------------------------------------------------
    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> dict:
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
