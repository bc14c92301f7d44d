"""How replies are judged, and the checks that keep a gold answer in exactly one document, read the same way."""

from __future__ import annotations

import json
import random
import re

from sglang_pic.entrypoints.tool_calls import ToolCall
from sglang_pic.span_quality.items import Gold, ToolGold


def normalize(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed: phrases then match as whole words."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _mention(phrase: str, padded_reply: str) -> int:
    at = padded_reply.find(f" {normalize(phrase)} ")
    return at if at >= 0 else len(padded_reply)


def says(text: str, phrase: str) -> bool:
    """Whether `text` holds `phrase` as whole words, as `judge` reads replies."""
    padded = f" {normalize(text)} "
    return _mention(phrase, padded) < len(padded)


def only_in(phrase: str, doc: str, docs: list[str]) -> bool:
    """Whether of `docs`, `doc` alone says `phrase`: a gold answer's document, with no rival saying it too."""
    return says(doc, phrase) and sum(says(d, phrase) for d in docs) == 1


def unsaid_number(rng: random.Random, docs: list[str]) -> str:
    """A three-digit number none of `docs` says, so the document a fact puts it in is the only one with it."""
    while True:
        n = str(rng.randint(100, 999))
        if not any(says(d, n) for d in docs):
            return n


def judge(gold: Gold | ToolGold, reply: str, calls: list[ToolCall]) -> tuple[bool, str]:
    """(whether `reply` is right, its key): replies with the same key give the same answer. A phrase answer's key
    is the gold and rival phrases it says, in order (its normalized text if it says none); a tool answer's key is
    its first call, arguments canonicalized."""
    if isinstance(gold, ToolGold):
        if not calls:
            return False, "text: " + normalize(reply)
        call = calls[0]
        args = json.loads(call.arguments)
        right = call.name == gold.name and all(k in args for k in gold.required)
        return right, f"{call.name}({json.dumps(args, sort_keys=True)})"
    padded = f" {normalize(reply)} "
    where = {p: _mention(p, padded) for p in (*gold.phrases, *gold.rivals)}
    said = sorted((at, p) for p, at in where.items() if at < len(padded))
    right = all(where[p] < len(padded) for p in gold.phrases) and said[0][1] in gold.phrases
    return right, " | ".join(normalize(p) for _, p in said) if said else normalize(reply)
