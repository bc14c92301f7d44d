"""Chat messages rendered into prompt text with a Jinja chat template.

Kept apart from the HTTP handlers because it is a pure function of its inputs: offline tools
(sglang_pic.span_quality) render chats exactly as the server does, and launch_server checks --chat-template early.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolSpanSettings
from sglang_pic.entrypoints.tool_calls import mark_tool_spans
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import format_settings

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


def render_chat(body: ChatCompletionRequest, tokenizer, chat_template: str | None, args: ServerArgs) -> str:
    """The prompt text, kept as text (not ids) so PIC markers inside messages still split it into segments."""
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
    if tools and (body.tool_spans if body.tool_spans is not None else args.tool_spans == "on"):
        ssep = args.ssep_marker
        if isinstance(body.tool_spans, ToolSpanSettings):
            own = body.tool_spans
            ssep += args.span_settings_marker + format_settings(own.model_dump())
        text = mark_tool_spans(text, tools, ssep, args.pdep_marker)
    return text
