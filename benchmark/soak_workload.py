"""What the soak's clients send: seeded prompt texts measured in the server's tokens (so prompts fit the budget),
span-marked and input_ids prompts built from them, sampling settings, and the tools a chat may list."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from soak_http import Http

SSEP, PDEP = "<|ssep|>", "<|pdep|>"  # the server's default markers (sglang_pic.frontend_lang)
SSEP_ID, PDEP_ID = -1, -2  # their input_ids forms (--ssep-token-id, --pdep-token-id)
WORDS = (
    "the quick brown fox jumps over lazy dog town sea river market bread apples morning tea book chapter children "
    "weather sunny rain west moon stars poem engine requests cache keys values tokens client capital city number "
    "story night farmer porch fishermen hello room model word learn function add two small little old first"
).split()
TOOL_PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": TOOL_PARAMS}}
    for name, text in (
        ("search", "Search a topic."),
        ("weather", "Weather in a city."),
        ("sql", "Run a SQL query."),
    )
]


@dataclass
class TextPool:
    """Seeded texts with their token counts (measured by the server's /tokenize), so prompts fit the budget."""

    texts: list[str]
    counts: list[int]

    def pick(self, rng: random.Random) -> tuple[str, int]:
        i = rng.randrange(len(self.texts))
        return self.texts[i], self.counts[i]


@dataclass
class Workload:
    prefixes: TextPool
    docs: TextPool  # span texts: a small pool, so spans recur at new offsets behind new prefixes
    questions: TextPool
    token_ids: list[int]  # ids of ordinary words, for input_ids prompts
    context_len: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_tools: int = 0  # how many tools a chat may list within the context
    tools_skipped: str = ""  # why tool chats are left out, if they are

    def marked_prompt(self, rng: random.Random) -> str:
        prefix, used = self.prefixes.pick(rng)
        question, q_len = self.questions.pick(rng)
        parts = [prefix]
        for _ in range(rng.randint(1, 3)):
            doc, n = self.docs.pick(rng)
            if used + n + q_len > self.max_prompt_tokens:
                break
            parts.append(SSEP + doc + PDEP)  # frontend_lang.span(doc)
            used += n
        return "".join(parts) + question

    def plain_prompt(self, rng: random.Random) -> str:
        prefix, _ = self.prefixes.pick(rng)
        question, _ = self.questions.pick(rng)
        return f"{prefix} {question}"

    def ids_prompt(self, rng: random.Random) -> list[int]:
        """A prefix, one or two spans (-1 ... ) and a PDEP question (-2 ...), as input_ids."""
        words = lambda n: [rng.choice(self.token_ids) for _ in range(n)]  # noqa: E731
        budget = max(8, self.max_prompt_tokens // 4)
        ids = words(rng.randint(1, budget))
        for _ in range(rng.randint(1, 2)):
            ids += [SSEP_ID, *words(rng.randint(1, budget))]
        return ids + [PDEP_ID, *words(rng.randint(1, budget))]

    def sampling(self, rng: random.Random, scale: int = 1) -> dict:
        return {
            "max_new_tokens": rng.randint(1, self.max_new_tokens * scale),
            "temperature": rng.choice((0.0, 0.7)),
            "ignore_eos": rng.random() < 0.5,
        }

    def too_long_prompt(self) -> str:
        return " ".join(["hello"] * (self.context_len + 8))


async def build_workload(
    http: Http, seed: int, max_prompt_tokens: int, max_new_tokens: int, context_len: int
) -> Workload:
    """Seeded text pools measured by the server's tokenizer, and how many tools a chat may list."""
    rng = random.Random(seed)

    def texts(n: int, lo: int, hi: int) -> list[str]:
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]

    pools = [texts(8, 2, 8), texts(16, 4, 24), texts(16, 2, 8)]
    counts = iter(await tokenize(http, {"prompt": [t for pool in pools for t in pool], "add_special_tokens": False}))
    prefixes, docs, questions = (TextPool(pool, [next(counts) for _ in pool]) for pool in pools)
    token_ids = sorted(set(await tokenize(http, {"prompt": " ".join(WORDS), "add_special_tokens": False}, "tokens")))
    longest_plain = max(prefixes.texts, key=len) + " " + max(questions.texts, key=len)
    max_tools, tools_skipped = await tools_that_fit(http, longest_plain, context_len - max_new_tokens)
    prompt_cap = min(max_prompt_tokens, context_len // 2)
    return Workload(prefixes, docs, questions, token_ids, context_len, prompt_cap, max_new_tokens, max_tools,
                    tools_skipped)


async def tokenize(http: Http, body: dict, key: str = "count") -> list:
    status, raw = await http.post("/tokenize", body)
    if status != 200:
        raise ValueError(f"/tokenize answered {status}: {raw[:300].decode(errors='replace')}")
    return json.loads(raw)[key]


async def tools_that_fit(http: Http, prompt: str, budget: int) -> tuple[int, str]:
    """How many of TOOLS a chat of `prompt` can list within `budget` prompt tokens; 0 and why when none fits or
    the chat template does not render tools."""
    fit, reason = 0, ""
    for k in range(1, len(TOOLS) + 1):
        body = {"messages": [{"role": "user", "content": prompt}], "tools": TOOLS[:k], "tool_spans": True}
        try:
            count = await tokenize(http, body)
        except ValueError as e:
            return 0, str(e)
        if count >= budget:
            reason = f"a chat with {k} tool(s) has {count} prompt tokens, over the budget of {budget}"
            break
        fit = k
    return fit, "" if fit else reason
