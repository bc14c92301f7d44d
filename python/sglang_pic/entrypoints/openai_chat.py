"""/v1/chat/completions: messages rendered with the chat template, the reply split into reasoning, content and
tool calls (chat_reply.py), answered whole or streamed as deltas. Output constraints (grammars, response_format,
a forced tool call) are checked here, since only one may shape a reply."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response

from sglang_pic.entrypoints.chat_reply import ChatReplyReader
from sglang_pic.entrypoints.chat_template import load_chat_template, render_chat
from sglang_pic.entrypoints.openai_handler import GenerationHandler
from sglang_pic.entrypoints.openai_output import (
    StreamCursor,
    chat_logprobs,
    finish_of,
    sse,
    tool_items,
    usage_of,
)
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest
from sglang_pic.entrypoints.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    UsageInfo,
)
from sglang_pic.entrypoints.reasoning import REASONING_PARSERS, ReasoningStream
from sglang_pic.entrypoints.tool_calls import ToolCallStream, tool_call_parser
from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq
from sglang_pic.managers.server_tokenizer_manager import ServerTokenizerManager
from sglang_pic.sampling.sampling_params import GRAMMAR_FIELDS

# Enough of a prompt's last tokens to see whether the chat template opened the reply's thinking.
_PROMPT_END_TOKENS = 16


class ChatHandler(GenerationHandler):
    body_model = ChatCompletionRequest
    rid_prefix = "chatcmpl"
    prompt_field = "messages"

    def __init__(self, manager: ServerTokenizerManager) -> None:
        super().__init__(manager)
        self.chat_template = load_chat_template(manager.server_args.chat_template, self.tokenizer)
        self.tool_parser = tool_call_parser(manager.server_args.tool_call_parser, manager.model_config.architecture)
        self.keep_special_tokens = self.tool_parser is not None and self.tool_parser.tags_are_special(self.tokenizer)
        self.reasoning = REASONING_PARSERS.get(manager.server_args.reasoning_parser)

    async def handle(self, request: Request) -> Response:
        parsed = await self.prepare(request)
        if isinstance(parsed, Response):
            return parsed
        body, rid, reqs = parsed
        model = self.manager.served_model_name
        outs = await self.replies(reqs, request, self._stream(body, reqs, rid, model, request) if body.stream else None)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(meta["output_token_logprobs"], meta["output_top_logprobs"])
            reason, matched = finish_of(out)
            reader = self._reply_reader(body, reqs[i])
            reply = reader.read(out["text"], last=True)
            content, calls = reply.content, []
            if reader.tools is not None:
                content, calls = content.strip(), reader.tools.whole_calls()
            message = ChatResponseMessage(
                role="assistant",
                content=content or None,
                reasoning_content=reply.reasoning or None,
                tool_calls=tool_items(calls),
            )
            if reader.called:
                reason, matched = "tool_calls", None
            choices.append(
                ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
            )
        response = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outs, body.n))
        return Response(response.model_dump_json(), media_type="application/json")

    def default_max_tokens(self) -> int:
        return self.manager.context_len  # OpenAI's: as many tokens as the context has room for

    def limit_field(self, body: ChatCompletionRequest) -> str:
        return "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"

    def _reply_reader(self, body: ChatCompletionRequest, req: TokenizedGenerateReq) -> ChatReplyReader:
        reasoning = None
        if self.reasoning is not None and body.separate_reasoning:
            reasoning = ReasoningStream(self.reasoning, self.tokenizer.decode(req.prompt_ids()[-_PROMPT_END_TOKENS:]))
        tools = None
        if body.uses_tools():
            names = {t.function.name for t in body.tools}
            tools = ToolCallStream(self.tool_parser, names, body.parallel_tool_calls, body.forced_tools() is not None)
        return ChatReplyReader(reasoning, tools)

    def to_input(self, body: ChatCompletionRequest, rid: str) -> GenerateReqInput:
        sampling = self.sampling(body, body.max_completion_tokens or body.max_tokens)
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
            if self.keep_special_tokens:
                sampling["skip_special_tokens"] = False
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
            **body.span_settings(),
        )

    def render_chat(self, body: ChatCompletionRequest) -> str:
        """The prompt text; markers in message content are honored, so a broken one is refused with its position in
        that content (in the rendered prompt it would mean nothing to the client)."""
        for i, message in enumerate(body.messages):
            try:
                self.manager.request_builder.segmenter.check_markers(message.text())
            except ValueError as e:
                raise ValueError(f"messages[{i}].content: {e}") from None
        return render_chat(body, self.tokenizer, self.chat_template, self.manager.server_args)

    def _stream(
        self, body: ChatCompletionRequest, reqs: list[TokenizedGenerateReq], rid: str, model: str, request: Request
    ) -> AsyncIterator[str]:
        readers = [self._reply_reader(body, req) for req in reqs]
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        def chunk(choice: ChatStreamChoice, out: dict) -> str:
            usage = usage_of([out], 1) if continuous else None
            return sse(ChatCompletionChunk(id=rid, model=model, choices=[choice], usage=usage))

        def chunks(i: int, out: dict, cursor: StreamCursor) -> Iterator[str]:
            if not cursor.started:
                cursor.started = True
                opening = ChatStreamChoice(index=i, delta=ChatResponseMessage(role="assistant", content=""))
                yield chunk(opening, out)
            delta, triples, tops = cursor.advance(out)
            reason, matched = finish_of(out)
            piece = readers[i].read(delta, last=reason is not None)
            logprobs = chat_logprobs(triples, tops) if body.logprobs and triples else None
            if piece.reasoning:
                thought = ChatResponseMessage(reasoning_content=piece.reasoning)
                yield chunk(ChatStreamChoice(index=i, delta=thought), out)
            if piece.content or logprobs:
                message = ChatResponseMessage(content=piece.content)
                yield chunk(ChatStreamChoice(index=i, delta=message, logprobs=logprobs), out)
            if piece.calls:
                message = ChatResponseMessage(tool_calls=tool_items(piece.calls))
                yield chunk(ChatStreamChoice(index=i, delta=message), out)
            if reason is not None and readers[i].called:
                reason, matched = "tool_calls", None
            if reason is not None:
                closing = ChatStreamChoice(
                    index=i, delta=ChatResponseMessage(), finish_reason=reason, matched_stop=matched
                )
                yield chunk(closing, out)

        def usage_chunk(usage: UsageInfo) -> str:
            return sse(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage), exclude_none=True)

        return self.stream_events(body, reqs, request, chunks, usage_chunk)
