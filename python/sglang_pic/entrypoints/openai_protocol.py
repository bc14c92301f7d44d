"""OpenAI-compatible request models (field names and defaults as in SGLang's /v1 adapters), and their validation
errors described for a 400; the fields completions and chat share are in openai_fields.py, responses in
openai_responses.py.

Requests are strict: unknown fields and wrong JSON types are rejected (with the field's name), never coerced, so a
client's typo surfaces as a 400 instead of a silently ignored setting; the fields of OpenAI's API and SGLang's
extensions that have no effect here are accepted at their neutral values (sglang_fields). Range checks on sampling
fields are left to `SamplingParams`, which names the field too, in the same words.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from sglang_pic.entrypoints.openai_fields import MAX_TOP_LOGPROBS, RequestModel, SamplingFields
from sglang_pic.sampling.sampling_params import check_range
from sglang_pic.sglang_fields import OPENAI_CHAT_API_FIELDS, OPENAI_FIELDS, Ignored, RefusedFields


def _top_logprobs_range(v: int | None, info: ValidationInfo) -> int | None:
    """How many alternatives per token a request may ask for (completions' logprobs, chat's top_logprobs)."""
    return v if v is None else check_range(info.field_name, v, 0, MAX_TOP_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: OpenAI's 16, cut to the room the prompt leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _logprobs_range = field_validator("logprobs")(_top_logprobs_range)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as the API returned it


class MessageToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall
    index: int | None = None  # ignored: there when a client sends back a call as it was streamed


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # ignored: there when a client sends back a reply message as it came

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the reply must follow (None: free text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return json.dumps(self.json_schema.schema_)
        return None


class ToolSpanSettings(RequestModel):
    """`tool_spans` as an object: tool descriptions become spans with these settings (span_policy.py)."""

    span_anchor: str | None = None
    span_head_tokens: int | None = None
    span_tail_tokens: int | None = None
    span_query_share: float | None = None


class ChatCompletionRequest(SamplingFields):
    ignored_fields: ClassVar[Mapping[str, Ignored]] = {**OPENAI_FIELDS, **OPENAI_CHAT_API_FIELDS}

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # None: the model's generation_config.json, else OpenAI's default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # sglang_pic extension: each tool description becomes a span, reused whatever tools precede it; an object gives
    # those spans their own settings. None: the server's --tool-spans.
    tool_spans: bool | ToolSpanSettings | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # SGLang's extension: with a --reasoning-parser, put the thinking in reasoning_content (False: leave it in content).
    separate_reasoning: bool = True

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    _top_logprobs_range = field_validator("top_logprobs")(_top_logprobs_range)

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) < len(names):
            raise ValueError("tool names must be distinct")
        return v

    def uses_tools(self) -> bool:
        """Whether the tools are shown to the model and its reply parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[Tool] | None:
        """The tools one of which the reply must call (tool_choice required or a named function), else None."""
        if self.tool_choice == "required":
            if not self.tools:
                raise ValueError("tool_choice 'required' needs tools")
            return self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            named = [t for t in self.tools or [] if t.function.name == name]
            if not named:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            return named
        return None



class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


class TokenizeRequest(RequestModel):
    """/tokenize and /v1/tokenize (SGLang's and vLLM's shape): the ids /generate runs for a prompt, or the ids
    /v1/chat/completions runs for chat messages (rendered as a chat request with these fields would be)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    text: str | list[str] | None = None  # /generate's name for the prompt; taken as `prompt`
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_spans: bool | ToolSpanSettings | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if self.prompt is not None and self.text is not None:
            raise ValueError("give either prompt or text (the same field under /generate's name), not both")
        if self.text is not None:
            self.prompt, self.text = self.text, None
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages (text, /generate's name for prompt, works too)")
        return self

    def chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt these messages make."""
        return ChatCompletionRequest(
            messages=self.messages, tools=self.tools, tool_spans=self.tool_spans,
            continue_final_message=self.continue_final_message, chat_template_kwargs=self.chat_template_kwargs,
        )



def describe_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic's (or FastAPI's) errors as one line naming each offending field once, e.g. `temperature: Input
    should be a valid number`, and the first offending field (OpenAI's `param`; None for the body as a whole)."""
    parts: dict[str, str] = {}
    params: list[str] = []
    for e in errors:
        loc = ".".join(str(x) for x in e["loc"] if not _is_union_branch(x))
        msg = e["msg"].removeprefix("Value error, ")
        refused = (e.get("ctx") or {}).get("error")
        if isinstance(refused, RefusedFields):
            params.extend(refused.names)
        elif loc:
            params.append(loc)
        if e["type"] == "extra_forbidden":
            parts.setdefault(loc, f"unknown field {loc!r}")
        else:
            named = not loc or msg.startswith(f"{loc} ")  # our own checks name their field
            parts.setdefault(loc, msg if named else f"{loc}: {msg}")
    return "; ".join(parts.values()), next(iter(params), None)


def _is_union_branch(loc_part: object) -> bool:
    """Pydantic names the union member it tried (`str`, `list[int]`, `TextPart`...) in error locations; drop it."""
    if not isinstance(loc_part, str):
        return False
    return "[" in loc_part or loc_part[:1].isupper() or loc_part in ("str", "int", "float", "bool", "dict", "list")
