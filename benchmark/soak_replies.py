"""What a good reply must look like: native and OpenAI bodies with a finish_reason, streams of JSON chunks ending in
[DONE], and constrained outputs that stay inside their language."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

# No minLength/maxLength: xgrammar 0.2.9 lets raw control characters into length-bounded strings (its issue #800).
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
ANSWER_REGEX = "[a-e]{1,8}( [0-9]{1,3})?"
ANSWER_REGEX_PREFIX = "[a-e]{0,8}( [0-9]{0,3})?"  # what an output cut short by max_new_tokens may be


def native_final(payload: object) -> dict:
    """The reply's (last) output dict; ValueError if it lacks a finish_reason."""
    out = payload[-1] if isinstance(payload, list) else payload
    if not isinstance(out, dict) or not (out.get("meta_info") or {}).get("finish_reason"):
        raise ValueError(f"no finish_reason in {str(out)[:200]}")
    return out


def stream_final(events: list[str], native: bool) -> dict:
    """Check a stream's shape (JSON chunks, then [DONE]) and return its last chunk."""
    if len(events) < 2 or events[-1] != "[DONE]":
        raise ValueError(f"the stream did not end in [DONE] after a chunk: {events[-2:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    if native:
        return native_final(chunks[-1])
    if not any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks):
        raise ValueError("no chunk carried a finish_reason")
    return chunks[-1]


def openai_text(reply: dict) -> str:
    choice = reply["choices"][0]
    if choice.get("finish_reason") is None:
        raise ValueError("the reply has no finish_reason")
    return choice["message"]["content"] if "message" in choice else choice["text"]


def check_constrained(how: str, text: str, finished: bool) -> None:
    """The text must stay inside the language: a prefix of it while cut by max_new_tokens, a member once done."""
    if how == "regex":
        if not re.fullmatch(ANSWER_REGEX if finished else ANSWER_REGEX_PREFIX, text):
            raise ValueError(f"regex output {text!r} left {ANSWER_REGEX!r}")
    elif finished:
        try:
            reply = json.loads(text)
        except ValueError as e:
            raise ValueError(f"json_schema output {text!r} is not JSON: {e}") from None
        if not isinstance(reply, dict) or set(reply) != {"answer", "sure"}:
            raise ValueError(f"json_schema output {text!r} does not fit the schema")
    elif not text.lstrip().startswith("{") and text.strip():
        raise ValueError(f"json_schema output {text!r} does not start an object")


def failure_of(status: int, validate: Callable[[], object]) -> str:
    """"" when a good request got a 200 whose body `validate` accepts, else what went wrong."""
    if status != 200:
        return f"a good request got {status}"
    try:
        validate()
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"malformed reply: {e}"
    return ""
