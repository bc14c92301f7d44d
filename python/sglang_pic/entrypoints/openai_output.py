"""Native generate outputs turned into the pieces of OpenAI responses: finish reasons, usage, logprobs, tool-call
items, and the cursor that cuts a stream's cumulative outputs into deltas. Shared by completions and chat, whose
whole and streamed answers must agree piece for piece."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from sglang_pic.entrypoints.openai_responses import (
    CalledFunction,
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    PromptTokensDetails,
    ToolCallItem,
    TopLogprob,
    UsageInfo,
)
from sglang_pic.entrypoints.tool_calls import CallDelta

STREAM_END = "data: [DONE]\n\n"


def sse(model: BaseModel, exclude_none: bool = False) -> str:
    """One server-sent event carrying `model` as JSON."""
    return f"data: {model.model_dump_json(exclude_none=exclude_none)}\n\n"


def finish_of(out: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """The output's finish reason and matched stop (None, None while it runs)."""
    reason = out["meta_info"]["finish_reason"]
    return (reason["type"], reason.get("matched")) if reason else (None, None)


def usage_of(outs: list[dict[str, Any]], n: int) -> UsageInfo:
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


def completion_logprobs(triples: list, tops: list, offset: int) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy logprobs object from (logprob, id, text) triples; returns the next text offset too."""
    lp = CompletionLogProbs()
    for (value, _, text), top in zip(triples, tops or [None] * len(triples)):
        lp.tokens.append(text)
        lp.token_logprobs.append(value)
        lp.text_offset.append(offset)
        offset += len(text)
        lp.top_logprobs.append({t[2]: t[0] for t in top} if top else None)
    return lp, offset


def chat_logprobs(triples: list, tops: list) -> ChatChoiceLogprobs:
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


def tool_items(calls: list[CallDelta]) -> list[ToolCallItem] | None:
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


@dataclass
class StreamCursor:
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
