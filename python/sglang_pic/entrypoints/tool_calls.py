"""Tool calls in chat completions: the model's calls parsed out of its text, and tool descriptions as spans.

A parser knows one model family's call format. `qwen25` (Qwen2.5/Qwen3, Hermes-style): each call is a JSON object
{"name", "arguments"} between <tool_call> and </tool_call>, text may surround them; small models often drop the
tags, so a reply made only of such objects counts too. `llama3` (Llama 3.1+): the whole reply is one or more JSON
objects {"name", "parameters"} separated by ";" (after an optional <|python_tag|>). `mistral`: text, then
[TOOL_CALLS] and a JSON list of {"name", "arguments"}. Only calls to the request's tools with JSON-object arguments
count; anything else stays text, so a malformed call reaches the client as content rather than an error.

Streamed, a call's arguments go out as they are written once the call is committed: its header (`{"name": ...,
"arguments": {`) names one of the request's tools and it stands where the format puts calls (in a `<tool_call>`
block, in Mistral's list after [TOOL_CALLS], or at the start of a llama3 reply, whose format is calls only), or
tool_choice forces a call. Bare objects in a qwen25 reply (tags dropped) go out whole at the end: only the end of
the reply can tell them from text. A call's arguments are the JSON text the model wrote, so streamed pieces add up
to the reply's arguments exactly. A llama3 reply that turns out to go on as text after its calls (not the format)
keeps the calls already sent and sends its text as content.

`mark_tool_spans` makes each tool description a span: agents resend the same tools in varying subsets and orders,
and as spans each description is prefilled once and reused behind any system prompt, at any offset.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import takewhile

from sglang_pic.parser_names import ToolCallParserName
from sglang_pic.sampling.stop_conditions import partial_prefix


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class CallDelta:
    """One call's progress in a stream; its first delta carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


# The opening of a call object written name first: what a stream needs to commit to the call.
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _call(name: object, arguments: object, names: set[str]) -> ToolCall | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _read_call(text: str, start: int, names: set[str]) -> tuple[ToolCall | None, int]:
    """The call whose JSON object starts at text[start], and where the object ends; raises JSONDecodeError if
    no whole JSON value starts there. Arguments written as an object after the name keep the model's text."""
    obj, end = json.JSONDecoder().raw_decode(text, start)
    if not isinstance(obj, dict):
        return None, end
    call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), names)
    partial = _partial_call(text[:end], start, names)
    if call is not None and partial is not None and partial.name == call.name:
        call = partial
    return call, end


def _partial_call(text: str, start: int, names: set[str]) -> ToolCall | None:
    """The call being written from text[start] so far: its name (one of `names`) and the argument text written
    yet; None before its header is whole."""
    m = _HEADER.match(text, start)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    if name not in names:
        return None
    end = _object_end(text, m.end())
    return ToolCall(name, text[m.end() : end if end is not None else len(text)])


def _object_end(text: str, start: int) -> int | None:
    """One past the bracket closing the JSON object or array opening at text[start]; None if not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


FENCE = "```"  # a Markdown code block, with or without a language tag on its opening line


def _unfenced(body: str) -> str:
    """`body` without a code fence around it: small models often wrap a call in ```json ... ``` (Qwen2.5-Coder-0.5B
    does on most turns of benchmark/bench_agent_tools.py). A fence is its opening line (``` and at most a language
    tag) and, unless the reply was cut off, a closing ```."""
    line_end = body.find("\n")
    if not body.startswith(FENCE) or line_end < 0:
        return body
    tag = body[len(FENCE) : line_end].strip()
    if tag and not tag.isalnum():
        return body
    return body[line_end + 1 :].strip().removesuffix(FENCE).strip()


def _reply_of_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls when `text` is nothing but JSON call objects (separated by whitespace or ";"), also inside one code
    fence, else []."""
    calls, pos = [], 0
    body = _unfenced(text.strip())
    while pos < len(body):
        try:
            call, pos = _read_call(body, pos, names)
        except json.JSONDecodeError:
            return []
        if call is None:
            return []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return calls


def _listed_objects(text: str, at: int, separators: str) -> list[int]:
    """Where the JSON objects written from text[at] start, one after another with whitespace and `separators`
    between them: the closed ones and the one being written."""
    starts = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if not text.startswith("{", at):
            return starts
        starts.append(at)
        end = _object_end(text, at)
        if end is None:
            return starts
        at = end


def _may_be_calls(text: str, prefix: str = "") -> bool:
    """Whether a reply so far may still turn out to be only calls (it opens with `prefix` or a JSON object)."""
    head = text.lstrip()
    fenced = head.startswith(FENCE) or FENCE.startswith(head)
    return not head or head.startswith("{") or fenced or (bool(prefix) and (head.startswith(prefix)
                                                                          or prefix.startswith(head)))


def _opener_at(text: str, opener: str) -> int:
    """Where `opener` starts in `text`, or where a partial opener ends it; len(text) if neither."""
    i = text.find(opener)
    return i if i >= 0 else len(text) - partial_prefix(text, opener)


class ToolCallParser(ABC):
    arguments_key: str | None = None  # how a reply that is one bare JSON call names its arguments; None: no such reply
    tags: tuple[str, ...] = ()  # the strings that mark calls in a reply

    def tags_are_special(self, tokenizer) -> bool:
        """Whether decoding without special tokens would drop a call tag (Llama 3's <|python_tag|> is a special
        token, Qwen's <tool_call> is not): only then must a reply keep its special tokens to be parsed, at the
        price of stray ones such as a small model's <|im_start|> landing in the text."""
        for tag in self.tags:
            ids = tokenizer.encode(tag, add_special_tokens=False)
            if tag not in tokenizer.decode(ids, skip_special_tokens=True):
                return True
        return False

    @abstractmethod
    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        """(the text without the calls, the calls to tools in `names`)."""

    def forced_call_schema(self, functions: list[dict]) -> dict:
        """A JSON schema for a reply that is one call to one of `functions` (OpenAI function objects), which this
        parser reads as a call: what tool_choice 'required' or a named function constrains the reply to."""
        if self.arguments_key is None:
            raise ValueError("forcing a tool call is not supported for this model family's call format")
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        self.arguments_key: f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", self.arguments_key],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        }

    @abstractmethod
    def call_starts(self, text: str) -> int:
        """Where a call may begin in `text`, counting a partial opener at its end (len(text): nowhere)."""

    def committed_calls(self, text: str) -> list[int]:
        """Where the objects of calls that the reply has committed to start, in order (a stream sends their
        arguments as they come); none by default, so calls go out whole once the reply has ended."""
        return []


class HermesParser(ToolCallParser):
    start = "<tool_call>"
    arguments_key = "arguments"
    tags = ("<tool_call>", "</tool_call>")
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        calls, kept, pos = [], [], 0
        for m in self._block.finditer(text):
            try:
                call, end = _read_call(text, m.start(1), names)
            except json.JSONDecodeError:
                continue
            if call is not None and end == m.end(1):
                calls.append(call)
                kept.append(text[pos : m.start()])
                pos = m.end()
        kept.append(text[pos:])
        if not calls:
            calls = _reply_of_calls(text, names)
            return ("", calls) if calls else (text, [])
        return "".join(kept), calls

    def call_starts(self, text: str) -> int:
        return 0 if _may_be_calls(text) else _opener_at(text, self.start)

    def committed_calls(self, text: str) -> list[int]:
        starts, pos = [], text.find(self.start)
        while pos >= 0:
            at = _skip_space(text, pos + len(self.start))
            if text.startswith("{", at):
                starts.append(at)
            pos = text.find(self.start, at)
        return starts


class Llama3JsonParser(ToolCallParser):
    _tag = "<|python_tag|>"
    arguments_key = "parameters"
    tags = (_tag,)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        calls = _reply_of_calls(text.strip().removeprefix(self._tag), names)
        return ("", calls) if calls else (text, [])

    def call_starts(self, text: str) -> int:
        """Calls fill the whole reply: hold it back while it could still be one."""
        return 0 if _may_be_calls(text, self._tag) else len(text)

    def committed_calls(self, text: str) -> list[int]:
        head = _skip_space(text, 0)
        if text.startswith(self._tag, head):
            head += len(self._tag)
        return _listed_objects(text, head, ";")


class MistralParser(ToolCallParser):
    start = "[TOOL_CALLS]"
    tags = (start,)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            listed, end = json.JSONDecoder().raw_decode(text, _skip_space(text, at + len(self.start)))
        except json.JSONDecodeError:
            return text, []
        objs = listed if isinstance(listed, list) else [listed]
        calls = [_call(o.get("name"), o.get("arguments", {}), names) if isinstance(o, dict) else None for o in objs]
        if not calls or None in calls or text[end:].strip():
            return text, []
        return text[:at], calls

    def call_starts(self, text: str) -> int:
        return _opener_at(text, self.start)

    def committed_calls(self, text: str) -> list[int]:
        at = text.find(self.start)
        if at < 0:
            return []
        at = _skip_space(text, at + len(self.start))
        return _listed_objects(text, at + 1, ",") if text.startswith("[", at) else []


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    ToolCallParserName.QWEN25: HermesParser,
    ToolCallParserName.LLAMA3: Llama3JsonParser,
    ToolCallParserName.MISTRAL: MistralParser,
}
ARCHITECTURE_PARSERS = {
    "Qwen2ForCausalLM": ToolCallParserName.QWEN25,
    "Qwen3ForCausalLM": ToolCallParserName.QWEN25,
    "LlamaForCausalLM": ToolCallParserName.LLAMA3,
    "MistralForCausalLM": ToolCallParserName.MISTRAL,
}


def tool_call_parser(name: str | None, architecture: str) -> ToolCallParser | None:
    """The parser named by --tool-call-parser, else the one of the model's family (None if it has none)."""
    name = name or ARCHITECTURE_PARSERS.get(architecture)
    return TOOL_CALL_PARSERS[name]() if name else None


class ToolCallStream:
    """Reads a reply, streamed or whole: passes its text on while holding back what may be a tool call, and the
    calls as deltas: committed calls' arguments as they are written, the rest when `finish` parses the whole reply
    (keeping the first call only unless calls may run in parallel). With `forced`, the reply is known to be one
    call (tool_choice constrains it), so it is committed from its first character."""

    def __init__(self, parser: ToolCallParser, names: set[str], parallel: bool = True, forced: bool = False) -> None:
        self.parser = parser
        self.names = names
        self.parallel = parallel
        self.forced = forced
        self.text = ""
        self.sent = 0  # characters of `text` already passed on as content
        self.calls: list[ToolCall] = []  # each call as far as it has been sent
        self.ids: list[str] = []

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The content that can be streamed now, and the calls' progress."""
        self.text += delta
        safe = max(self.parser.call_starts(self.text), self.sent)
        out, self.sent = self.text[self.sent : safe], safe
        starts = [self.text.find("{")] if self.forced and "{" in self.text else self.parser.committed_calls(self.text)
        partial = [_partial_call(self.text, at, self.names) for at in starts]
        return out, self._advance(list(takewhile(lambda c: c is not None, partial)))

    def finish(self) -> tuple[str, list[CallDelta]]:
        """(content not streamed yet, the rest of the calls)."""
        content, calls = self.parser.parse(self.text, self.names)
        rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
        return rest, self._advance(calls)

    def whole_calls(self) -> list[CallDelta]:
        """Each call sent so far as one delta: a whole reply's calls."""
        return [CallDelta(i, c.arguments, self.ids[i], c.name) for i, c in enumerate(self.calls)]

    def _advance(self, calls: list[ToolCall]) -> list[CallDelta]:
        """Deltas taking the sent calls to `calls`. A sent call that `calls` does not continue (a committed call the
        finished reply turned out not to hold) stays as it was sent."""
        deltas = []
        for i, call in enumerate(calls if self.parallel else calls[:1]):
            if i == len(self.calls):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.calls.append(call)
                deltas.append(CallDelta(i, call.arguments, self.ids[i], call.name))
                continue
            sent = self.calls[i]
            if call.name == sent.name and call.arguments.startswith(sent.arguments) and call != sent:
                self.calls[i] = call
                deltas.append(CallDelta(i, call.arguments[len(sent.arguments) :]))
        return deltas


def mark_tool_spans(prompt: str, tools: list[dict], ssep: str, pdep: str) -> str:
    """Make each tool's rendering in `prompt` a span (`ssep` before it, which may carry the span's settings, and
    `pdep` after it unless the next tool follows at once). Templates render tools with json.dumps (Jinja's tojson),
    compactly or indented; the first layout that finds every tool, in order, is used."""
    for indent in (None, 4, 2):
        places, pos = [], 0
        for tool in tools:
            rendered = json.dumps(tool, ensure_ascii=False, indent=indent)
            at = prompt.find(rendered, pos)
            if at < 0:
                break
            places.append((at, at + len(rendered)))
            pos = at + len(rendered)
        else:
            out, pos = [], 0
            for i, (begin, end) in enumerate(places):
                out += [prompt[pos:begin], ssep, prompt[begin:end]]
                following = places[i + 1][0] if i + 1 < len(places) else len(prompt)
                if following > end:
                    out.append(pdep)
                pos = end
            out.append(prompt[pos:])
            return "".join(out)
    raise ValueError("tool_spans: the chat template's rendering of the tools was not found in the prompt")
