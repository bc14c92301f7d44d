"""Bounded soak test of a server on this machine: many concurrent clients send a seeded mix of good requests,
hang-ups, aborts and bad inputs for a fixed time; then the server must be idle again with its KV pool whole.

    python benchmark/soak.py [--model-path DIR] [--duration 120] [--clients 64] [--output FILE] [-- SERVER FLAGS]
    python benchmark/soak.py --url http://127.0.0.1:30000 [--server-pid PID] ...

Without `--url` it starts `python -m sglang_pic.launch_server` on a free loopback port (no `--model-path`: the
embedded Qwen2.5-Coder-0.5B-Instruct); everything after `--` goes to the server. It only ever talks to loopback.

Each client loops over request kinds drawn from a seeded mix: native /generate (plain, span-marked and input_ids
prompts, streamed or not), /v1/completions, /v1/chat/completions (with `tools` and `tool_spans` where the chat
template renders tools and they fit the context), constrained decoding (where the server has a grammar backend),
clients that hang up after the first streamed chunk, explicit aborts by rid, and bad inputs that must get a 4xx.
Client i sends kind i first, so with at least as many clients as kinds every kind is sent. Every request has a
generous client timeout; one that reaches it is hung. After the clients stop it waits for the server to drain and reads
/get_server_info and /get_load: nothing running or waiting, free + evictable KV slots = the pool, and after
/flush_cache every slot free. It also reports the scheduler process's RSS before and after, and its CPU time over
a few idle seconds (a polling loop that spins burns a core).

Must-hold figures (the exit code is 1 if any fails): no 5xx, no hung request, no transport error, every bad input a
4xx and every good request a 2xx with a well-formed body, the KV accounting idle after the drain, the idle
scheduler's CPU under `--idle-cpu-limit`, and the server still alive.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import ipaddress
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import psutil

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
# No minLength/maxLength: xgrammar 0.2.9 lets raw control characters into length-bounded strings (its issue #800).
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
ANSWER_REGEX = "[a-e]{1,8}( [0-9]{1,3})?"
ANSWER_REGEX_PREFIX = "[a-e]{0,8}( [0-9]{0,3})?"  # what an output cut short by max_new_tokens may be
LATENCY_PERCENTILES = (0.5, 0.99)


# ---- configuration ----------------------------------------------------------------------------------------
@dataclass
class SoakConfig:
    url: str
    clients: int = 64
    duration_s: float = 60.0
    max_requests: int | None = None
    seed: int = 0
    request_timeout_s: float = 60.0  # a request still unanswered after this is hung
    max_new_tokens: int = 16
    max_prompt_tokens: int = 160
    drain_timeout_s: float = 60.0
    idle_cpu_window_s: float = 3.0
    idle_cpu_limit_s: float = 0.5
    progress_interval_s: float = 5.0


def loopback_url(url: str) -> str:
    """`url` without a trailing slash; SystemExit unless it is plain http to a loopback address."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if parts.scheme != "http" or not loopback or parts.port is None:
        raise SystemExit(
            f"soak.py only targets a server on this machine: --url must be http://127.0.0.1:PORT (or localhost), "
            f"got {url!r}"
        )
    return url.rstrip("/")


# ---- outcomes and their tally ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    status: int | None  # HTTP status; None when no response arrived
    latency_s: float
    failure: str = ""  # why this request breaks the soak's rules ("" = it kept them)
    hung: bool = False
    transport_error: bool = False
    aborted: bool = False  # finished with finish_reason abort (the abort kinds)


@dataclass
class KindStats:
    count: int = 0
    status: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    hung: int = 0
    transport_errors: int = 0
    failures: int = 0
    aborted: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        self.count += 1
        if out.status is not None:
            self.status[f"{out.status // 100}xx"] += 1
        self.hung += out.hung
        self.transport_errors += out.transport_error
        self.failures += bool(out.failure)
        self.aborted += out.aborted
        if not out.hung:
            self.latencies.append(out.latency_s)

    def summary(self) -> dict:
        ordered = sorted(self.latencies)
        pct = {f"p{round(q * 100)}_s": percentile(ordered, q) for q in LATENCY_PERCENTILES}
        return {
            "count": self.count,
            **{key: self.status.get(key, 0) for key in ("2xx", "4xx", "5xx")},
            "hung": self.hung,
            "transport_errors": self.transport_errors,
            "failures": self.failures,
            "aborted": self.aborted,
            **pct,
        }


def clip(value: object, limit: int = 2000) -> str:
    text = value.decode(errors="replace") if isinstance(value, bytes) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def percentile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


# ---- the workload -----------------------------------------------------------------------------------------------
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


async def build_workload(http: "Http", config: SoakConfig, context_len: int) -> Workload:
    rng = random.Random(config.seed)

    def texts(n: int, lo: int, hi: int) -> list[str]:
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]

    pools = [texts(8, 2, 8), texts(16, 4, 24), texts(16, 2, 8)]
    counts = iter(await tokenize(http, {"prompt": [t for pool in pools for t in pool], "add_special_tokens": False}))
    prefixes, docs, questions = (TextPool(pool, [next(counts) for _ in pool]) for pool in pools)
    token_ids = sorted(set(await tokenize(http, {"prompt": " ".join(WORDS), "add_special_tokens": False}, "tokens")))
    longest_plain = max(prefixes.texts, key=len) + " " + max(questions.texts, key=len)
    max_tools, tools_skipped = await tools_that_fit(http, longest_plain, context_len - config.max_new_tokens)
    prompt_cap = min(config.max_prompt_tokens, context_len // 2)
    return Workload(prefixes, docs, questions, token_ids, context_len, prompt_cap, config.max_new_tokens, max_tools,
                    tools_skipped)


async def tokenize(http: "Http", body: dict, key: str = "count") -> list:
    status, raw = await http.post("/tokenize", body)
    if status != 200:
        raise ValueError(f"/tokenize answered {status}: {raw[:300].decode(errors='replace')}")
    return json.loads(raw)[key]


async def tools_that_fit(http: "Http", prompt: str, budget: int) -> tuple[int, str]:
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


class Http:
    """One aiohttp session against the server; every request carries the per-request hang timeout. Redirects are
    not followed (and aiohttp ignores proxy settings by default), so nothing leaves the loopback address."""

    def __init__(self, base: str, timeout_s: float, connections: int) -> None:
        self.base = base
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections))

    async def close(self) -> None:
        await self.session.close()

    async def post(self, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        async with self.session.post(
            self.base + path, data=data, headers=headers, timeout=self.timeout, allow_redirects=False
        ) as resp:
            return resp.status, await resp.read()

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.session.get(self.base + path, timeout=self.timeout, allow_redirects=False) as resp:
            return resp.status, await resp.read()

    async def stream(
        self, path: str, body: dict, on_first: Callable[[], Awaitable[None]] | None = None, hang_up: bool = False
    ) -> tuple[int, list[str]]:
        """The `data:` payloads of a streamed reply. `on_first` runs after the first one; `hang_up` closes the
        connection there instead of reading on."""
        async with self.session.post(self.base + path, json=body, timeout=self.timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                return resp.status, [(await resp.read()).decode(errors="replace")]
            events: list[str] = []
            async for line in resp.content:
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                events.append(text[5:].strip())
                if len(events) == 1:
                    if hang_up:
                        resp.close()
                        return resp.status, events
                    if on_first is not None:
                        await on_first()
            return resp.status, events


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


class Client:
    """One soak client: its request kinds as methods returning (status, failure or "", aborted)."""

    Result = tuple[int, str, bool]

    def __init__(self, http: Http, work: Workload, client_id: int) -> None:
        self.http = http
        self.work = work
        self.id = client_id
        self.sent = 0
        self.request: dict = {}  # the last request sent, and what came back, for the report's failure examples
        self.reply: object = None

    async def post(self, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, bytes]:
        self.request, self.reply = {"path": path, "body": body if raw is None else raw.decode()}, None
        status, self.reply = await self.http.post(path, body, raw)
        return status, self.reply

    async def stream(self, path: str, body: dict, **kw) -> tuple[int, list[str]]:
        self.request, self.reply = {"path": path, "body": body}, None
        status, self.reply = await self.http.stream(path, body, **kw)
        return status, self.reply

    # -- native /generate
    async def generate(self, rng: random.Random, form: str, stream: bool) -> Result:
        body = self.native_body(rng, form) | {"stream": stream}
        if stream:
            status, events = await self.stream("/generate", body)
            return status, self.check(status, lambda: stream_final(events, native=True)), False
        status, raw = await self.post("/generate", body)
        return status, self.check(status, lambda: native_final(json.loads(raw))), False

    def native_body(self, rng: random.Random, form: str) -> dict:
        params = self.work.sampling(rng)
        if form == "ids":
            return {"input_ids": self.work.ids_prompt(rng), "sampling_params": params}
        text = self.work.marked_prompt(rng) if form == "spans" else self.work.plain_prompt(rng)
        return {"text": text, "sampling_params": params}

    async def constrained(self, rng: random.Random, how: str) -> Result:
        params = self.work.sampling(rng, scale=2) | {"temperature": 0.0, "ignore_eos": False}
        if how == "regex":
            params["regex"] = ANSWER_REGEX
        else:
            params["json_schema"] = json.dumps(ANSWER_SCHEMA)
        status, raw = await self.post("/generate", {"text": self.work.plain_prompt(rng), "sampling_params": params})

        def check() -> None:
            out = native_final(json.loads(raw))
            self.check_constrained(how, out["text"], out["meta_info"]["finish_reason"]["type"] == "stop")

        return status, self.check(status, check), False

    @staticmethod
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

    # -- OpenAI routes
    async def openai(
        self, rng: random.Random, route: str, stream: bool, extra: dict | None = None, prompt: str | None = None
    ) -> Result:
        params = self.work.sampling(rng)
        prompt = self.work.marked_prompt(rng) if prompt is None else prompt
        body: dict = {"max_tokens": params["max_new_tokens"], "temperature": params["temperature"]}
        if route == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        body |= (extra or {}) | {"stream": stream}
        if stream:
            status, events = await self.stream(path, body)
            return status, self.check(status, lambda: stream_final(events, native=False)), False
        status, raw = await self.post(path, body)
        return status, self.check(status, lambda: openai_text(json.loads(raw))), False

    async def chat_tools(self, rng: random.Random, stream: bool) -> Result:
        tools = rng.sample(TOOLS, rng.randint(1, self.work.max_tools))
        extra = {"tools": tools, "tool_spans": True}
        return await self.openai(rng, "chat", stream, extra, self.work.plain_prompt(rng))  # the tools fill the rest

    async def response_format(self, rng: random.Random) -> Result:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
        status, raw = await self.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": self.work.plain_prompt(rng)}],
            "max_tokens": self.work.max_new_tokens * 2, "temperature": 0, "response_format": fmt,
        })

        def check() -> None:
            reply = json.loads(raw)
            text = openai_text(reply)
            self.check_constrained("json_schema", text, reply["choices"][0]["finish_reason"] == "stop")

        return status, self.check(status, check), False

    # -- hang-ups and aborts
    async def disconnect(self, rng: random.Random, route: str) -> Result:
        if route == "chat":
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": self.work.marked_prompt(rng)}],
                    "max_tokens": self.work.max_new_tokens * 4, "stream": True}
        else:
            path = "/generate"
            body = self.native_body(rng, "spans") | {"stream": True}
            body["sampling_params"] |= {"max_new_tokens": self.work.max_new_tokens * 4, "ignore_eos": True}
        status, events = await self.stream(path, body, hang_up=True)
        return status, self.check(status, lambda: events or _raise("no chunk before hanging up")), False

    async def abort(self, rng: random.Random, stream: bool) -> Result:
        self.sent += 1
        rid = f"soak-{self.id}-{self.sent}"
        body = self.native_body(rng, rng.choice(("plain", "spans"))) | {"rid": rid, "stream": stream}
        body["sampling_params"] |= {"max_new_tokens": self.work.max_new_tokens * 4, "ignore_eos": True}
        abort_status: list[int] = []

        async def send_abort() -> None:
            status, _ = await self.http.post("/abort_request", {"rid": rid})
            abort_status.append(status)

        if stream:
            status, events = await self.stream("/generate", body, on_first=send_abort)
            final = lambda: stream_final(events, native=True)  # noqa: E731
        else:
            async def delayed_abort() -> None:
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                await send_abort()

            (status, raw), _ = await asyncio.gather(self.post("/generate", body), delayed_abort())
            final = lambda: native_final(json.loads(raw))  # noqa: E731
        failure = self.check(status, final)
        if not failure and abort_status != [200]:
            failure = f"/abort_request answered {abort_status}"
        aborted = not failure and final()["meta_info"]["finish_reason"]["type"] == "abort"
        return status, failure, aborted

    # -- bad inputs: each must be a 4xx
    async def bad(self, rng: random.Random, case: str) -> Result:
        path, body, raw = BAD_INPUTS[case](self.work, rng)
        status, reply = await self.post(path, body, raw)
        if not 400 <= status < 500:
            return status, f"a bad input ({case}) got {status}: {reply[:200]!r}", False
        try:
            message = json.loads(reply)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return status, f"the {status} for {case} has no error message: {reply[:200]!r}", False
        return status, "" if message else f"the {status} for {case} has an empty message", False

    @staticmethod
    def check(status: int, validate: Callable[[], object]) -> str:
        if status != 200:
            return f"a good request got {status}"
        try:
            validate()
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"malformed reply: {e}"
        return ""


def _raise(message: str) -> None:
    raise ValueError(message)


BadInput = tuple[str, object, bytes | None]  # path, JSON body, raw body
FEW = {"max_new_tokens": 2}
HELLO = {"text": "hello", "sampling_params": FEW}
BAD_INPUTS: dict[str, Callable[[Workload, random.Random], BadInput]] = {
    "empty_span": lambda w, r: ("/generate", {"text": SSEP + PDEP + "x", "sampling_params": FEW}, None),
    "marker_only": lambda w, r: ("/generate", {"text": PDEP} if r.random() < 0.5 else {"input_ids": [PDEP_ID] * 2},
                                 None),
    "unknown_field": lambda w, r: ("/generate", HELLO | {"temprature": 0}, None),
    "wrong_type": lambda w, r: ("/generate", HELLO | {"sampling_params": {"max_new_tokens": "8"}}, None),
    "invalid_json": lambda w, r: ("/generate", None, b'{"text": "hello", "sampling_params": {'),
    "too_long": lambda w, r: ("/generate", {"text": w.too_long_prompt(), "sampling_params": FEW}, None),
    "bad_regex": lambda w, r: ("/generate", HELLO | {"sampling_params": {**FEW, "regex": "(a+"}}, None),
    "unknown_route": lambda w, r: ("/v1/no_such_route", {"prompt": "hello"}, None),
    "openai_wrong_type": lambda w, r: ("/v1/chat/completions", {"messages": "hello", "max_tokens": 2}, None),
}
BAD_CASES = tuple(BAD_INPUTS)
KindFn = Callable[[Client, random.Random], Awaitable[Client.Result]]


def request_kinds(grammar: bool, tools: bool) -> dict[str, tuple[float, KindFn]]:
    """kind name -> (weight in the mix, how to send it). Constrained and tool kinds only where the server has them."""
    kinds: dict[str, tuple[float, KindFn]] = {}
    for form in ("plain", "spans", "ids"):
        for stream in (False, True):
            name = f"generate:{form}" + (":stream" if stream else "")
            kinds[name] = (4.0, lambda c, r, f=form, s=stream: c.generate(r, f, s))
    for route in ("completions", "chat"):
        for stream in (False, True):
            kinds[f"{route}" + (":stream" if stream else "")] = (3.0, lambda c, r, o=route, s=stream: c.openai(r, o, s))
    if tools:
        kinds["chat:tools"] = (2.0, lambda c, r: c.chat_tools(r, False))
        kinds["chat:tools:stream"] = (2.0, lambda c, r: c.chat_tools(r, True))
    if grammar:
        kinds["generate:regex"] = (2.0, lambda c, r: c.constrained(r, "regex"))
        kinds["generate:json_schema"] = (2.0, lambda c, r: c.constrained(r, "json_schema"))
        kinds["chat:response_format"] = (2.0, lambda c, r: c.response_format(r))
    kinds["disconnect:generate"] = (2.0, lambda c, r: c.disconnect(r, "generate"))
    kinds["disconnect:chat"] = (1.0, lambda c, r: c.disconnect(r, "chat"))
    kinds["abort"] = (1.5, lambda c, r: c.abort(r, False))
    kinds["abort:stream"] = (1.5, lambda c, r: c.abort(r, True))
    for case in BAD_CASES:
        kinds[f"bad:{case}"] = (1.0, lambda c, r, k=case: c.bad(r, k))
    return kinds


async def probe(http: Http, path: str, body: dict) -> str:
    """"" when the server serves `body` with a 200, else why not (its message)."""
    status, raw = await http.post(path, body)
    return "" if status == 200 else f"{status}: {raw[:300].decode(errors='replace')}"


# ---- the server's processes ------------------------------------------------------------------------------------
def scheduler_process(server_pid: int | None) -> psutil.Process | None:
    """The server's first multiprocessing worker child: launch_server starts the scheduler before the others."""
    if server_pid is None:
        return None
    try:
        workers = [
            p for p in psutil.Process(server_pid).children()
            if any("spawn_main" in part for part in p.cmdline())
        ]
    except psutil.Error:
        return None
    return min(workers, key=lambda p: (p.create_time(), p.pid), default=None)


def listener_pid(port: int) -> int | None:
    """The pid of this user's process listening on 127.0.0.1:`port`, if psutil can see it."""
    for proc in psutil.process_iter():
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return proc.pid
        except psutil.Error:
            continue
    return None


def rss_mib(proc: psutil.Process | None) -> float | None:
    try:
        return proc.memory_info().rss / 2**20 if proc is not None else None
    except psutil.Error:
        return None


def growth(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def cpu_or_none(proc: psutil.Process | None) -> float | None:
    try:
        return cpu_s(proc) if proc is not None else None
    except psutil.Error:
        return None


# ---- the run ---------------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, config: SoakConfig, server_pid: int | None) -> None:
        self.config = config
        self.server_pid = server_pid
        self.scheduler = scheduler_process(server_pid)
        self.stats: dict[str, KindStats] = defaultdict(KindStats)
        self.examples: list[dict] = []  # the first failures, for the report
        self.issued = 0
        self.in_flight = 0
        self.deadline = 0.0
        self.rss_series: list[tuple[float, float | None]] = []

    def take_ticket(self) -> bool:
        if time.monotonic() >= self.deadline:
            return False
        if self.config.max_requests is not None and self.issued >= self.config.max_requests:
            return False
        self.issued += 1
        return True

    async def run_one(self, kind: str, send: KindFn, client: Client, rng: random.Random) -> Outcome:
        start = time.monotonic()
        self.in_flight += 1
        try:
            status, failure, aborted = await send(client, rng)
            out = Outcome(kind, status, time.monotonic() - start, failure, aborted=aborted)
        except TimeoutError:
            elapsed = time.monotonic() - start
            out = Outcome(kind, None, elapsed, f"hung: no full reply in {elapsed:.0f} s", hung=True)
        except aiohttp.ClientError as e:
            out = Outcome(kind, None, time.monotonic() - start, f"transport: {type(e).__name__}: {e}",
                          transport_error=True)
        finally:
            self.in_flight -= 1
        self.stats[kind].add(out)
        if out.failure and len(self.examples) < 20:
            self.examples.append({"kind": kind, "status": out.status, "failure": out.failure,
                                  "request": clip(client.request), "reply": clip(client.reply)})
        return out

    async def client_loop(self, client: Client, kinds: dict[str, tuple[float, KindFn]]) -> None:
        """Client i first sends kind i (so with as many clients as kinds every kind is sent), then the mix."""
        rng = random.Random(self.config.seed * 100_003 + client.id)
        names = list(kinds)
        weights = [kinds[n][0] for n in names]
        kind = names[client.id % len(names)]
        while self.take_ticket():
            await self.run_one(kind, kinds[kind][1], client, rng)
            kind = rng.choices(names, weights)[0]

    async def progress(self, start: float) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            elapsed = time.monotonic() - start
            self.rss_series.append((round(elapsed, 1), rss_mib(self.scheduler)))
            totals = self.totals()
            print(
                f"[soak] {elapsed:5.0f}s/{self.config.duration_s:.0f}s  requests {self.issued} "
                f"({self.issued / elapsed:.1f}/s)  in flight {self.in_flight}  5xx {totals['5xx']}  "
                f"hung {totals['hung']}  failures {totals['failures']}",
                file=sys.stderr, flush=True,
            )

    def totals(self) -> dict:
        keys = ("count", "2xx", "4xx", "5xx", "hung", "transport_errors", "failures", "aborted")
        summaries = [s.summary() for s in self.stats.values()]
        return {k: sum(s[k] for s in summaries) for k in keys}

    async def run(self) -> dict:
        cfg = self.config
        http = Http(cfg.url, cfg.request_timeout_s, cfg.clients + 8)
        try:
            return await self._run(http)
        finally:
            await http.close()

    async def _run(self, http: Http) -> dict:
        cfg = self.config
        info = json.loads((await http.get("/get_server_info"))[1])
        work = await build_workload(http, cfg, info["context_len"])
        skipped = {
            "constrained": await probe(http, "/generate", {"text": "hi", "sampling_params": {
                "max_new_tokens": 1, "regex": "[ab]"}}),
            "tools": work.tools_skipped,
        }
        kinds = request_kinds(grammar=not skipped["constrained"], tools=not skipped["tools"])
        await drain(http, cfg.drain_timeout_s)
        rss_start, cpu_start = rss_mib(self.scheduler), cpu_or_none(self.scheduler)
        start = time.monotonic()
        self.deadline = start + cfg.duration_s
        ticker = asyncio.create_task(self.progress(start))
        clients = [Client(http, work, i) for i in range(cfg.clients)]
        await asyncio.gather(*(self.client_loop(c, kinds) for c in clients))
        load_s = time.monotonic() - start
        load_cpu = growth(cpu_start, cpu_or_none(self.scheduler))
        ticker.cancel()
        try:
            kv = await drain(http, cfg.drain_timeout_s)
            idle_cpu = await idle_cpu_s(self.scheduler, cfg.idle_cpu_window_s)
            rss_end = rss_mib(self.scheduler)
            flushed = await flush_and_count(http)
            alive = (await http.get("/health"))[0] == 200
        except (TimeoutError, aiohttp.ClientError) as e:  # the server died or stopped answering
            unreachable = {"idle": False, "all_free": False, "error": f"{type(e).__name__}: {e}"}
            kv, idle_cpu, rss_end, flushed, alive = unreachable, None, None, unreachable, False
        totals = self.totals()
        checks = {
            "no_5xx": totals["5xx"] == 0,
            "no_hung": totals["hung"] == 0,
            "no_transport_errors": totals["transport_errors"] == 0,
            "every_request_as_expected": totals["failures"] == 0,
            "kv_idle_after_drain": kv["idle"],
            "kv_free_after_flush": flushed["all_free"],
            "idle_scheduler_cpu": idle_cpu is None or idle_cpu < cfg.idle_cpu_limit_s,
            "server_alive": alive,
        }
        return {
            "config": asdict(cfg),
            "server_pid": self.server_pid,
            "skipped_kinds": {k: v for k, v in skipped.items() if v},
            "load_s": load_s,
            "requests": totals["count"],
            "requests_per_s": totals["count"] / load_s,
            "totals": totals,
            "kinds": {k: self.stats[k].summary() for k in sorted(self.stats)},
            "kv_after_drain": kv,
            "kv_after_flush": flushed,
            "scheduler": {
                "pid": self.scheduler.pid if self.scheduler else None,
                "rss_start_mib": rss_start,
                "rss_end_mib": rss_end,
                "rss_growth_mib": growth(rss_start, rss_end),
                # from the first progress tick on: what the run adds once caches and pools have warmed up
                "rss_growth_after_first_tick_mib": growth(self.rss_series[0][1] if self.rss_series else None, rss_end),
                "rss_series_mib": self.rss_series,
                # CPU seconds the scheduler got while the clients ran: far below load_s times its threads on a
                # busy machine means it waited for cores, which explains a slow run
                "load_cpu_s": load_cpu,
                "idle_cpu_s": idle_cpu,
                "idle_cpu_window_s": cfg.idle_cpu_window_s,
            },
            "failure_examples": self.examples,
            "checks": checks,
            "passed": all(checks.values()),
        }


async def drain(http: Http, timeout_s: float) -> dict:
    """Wait until nothing runs or waits and every KV slot is free or only cached; the last reading either way."""
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    while True:
        states = json.loads((await http.get("/get_server_info"))[1])["internal_states"]
        loads = json.loads((await http.get("/get_load"))[1])
        idle = all(
            s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
            and s["available_tokens"] + s["evictable_tokens"] == s["max_total_num_tokens"]
            for s in states
        ) and all(load["num_reqs"] == 0 and load["num_tokens"] == 0 for load in loads)
        if idle or time.monotonic() > deadline:
            keys = ("num_running_reqs", "num_waiting_reqs", "available_tokens", "evictable_tokens",
                    "max_total_num_tokens", "token_usage")
            return {"idle": idle, "drain_s": time.monotonic() - start,
                    "replicas": [{k: s[k] for k in keys} for s in states], "get_load": loads}
        await asyncio.sleep(0.2)


async def flush_and_count(http: Http) -> dict:
    """/flush_cache on the idle server, then every slot must be free: what the cache held was all it held."""
    status, _ = await http.post("/flush_cache", raw=b"")
    states = json.loads((await http.get("/get_server_info"))[1])["internal_states"]
    free = [(s["available_tokens"], s["max_total_num_tokens"]) for s in states]
    return {"flush_status": status, "available_vs_total": free,
            "all_free": status == 200 and all(a == t for a, t in free)}


async def idle_cpu_s(proc: psutil.Process | None, window_s: float) -> float | None:
    """CPU seconds (user + system) the process spends over `window_s` of idleness."""
    if proc is None:
        return None
    try:
        before = cpu_s(proc)
        await asyncio.sleep(window_s)
        return cpu_s(proc) - before
    except psutil.Error:
        return None


async def run_soak(config: SoakConfig, server_pid: int | None = None) -> dict:
    return await Soak(config, server_pid).run()


# ---- a server of its own ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """`python -m sglang_pic.launch_server` on a free loopback port, stopped (its whole session) on exit."""

    def __init__(self, model_path: str | None, extra: list[str], log_path: Path, startup_timeout_s: float) -> None:
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in extra):
                raise SystemExit(f"soak.py sets {flag} itself (loopback, a free port); drop it from the server flags")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_pic.launch_server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--model-path", model_path] if model_path else []
        self.log_path = log_path
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd + extra, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.startup_timeout_s = startup_timeout_s

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with code {self.proc.returncode}; its log: {self.log_path}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)  # direct: no proxy settings
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"the server was not healthy after {self.startup_timeout_s:.0f} s; its log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- report ----------------------------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    cols = ("count", "2xx", "4xx", "5xx", "hung", "transport_errors", "failures", "aborted")
    header = f"{'kind':26}" + "".join(f"{c[:9]:>10}" for c in cols) + f"{'p50 ms':>10}{'p99 ms':>10}"
    lines = [header, "-" * len(header)]
    for kind, s in report["kinds"].items():
        lines.append(f"{kind:26}" + "".join(f"{s[c]:>10}" for c in cols) + f"{ms(s['p50_s']):>10}{ms(s['p99_s']):>10}")
    t = report["totals"]
    lines.append(f"{'total':26}" + "".join(f"{t[c]:>10}" for c in cols))
    sched, kv, flushed = report["scheduler"], report["kv_after_drain"], report["kv_after_flush"]
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines += [
        "",
        f"requests {report['requests']} in {report['load_s']:.1f} s ({report['requests_per_s']:.1f}/s)",
        f"skipped kinds: {report['skipped_kinds'] or 'none'}",
        f"KV after drain: idle {kv['idle']}, {kv.get('replicas', kv.get('error'))}",
        f"KV after flush (available, total): {flushed.get('available_vs_total', flushed.get('error'))}",
        f"scheduler pid {sched['pid']}: RSS {fmt(sched['rss_start_mib'], '.1f')} -> {fmt(sched['rss_end_mib'], '.1f')}"
        f" MiB (growth {fmt(sched['rss_growth_mib'], '+.1f')}, after the first tick "
        f"{fmt(sched['rss_growth_after_first_tick_mib'], '+.1f')}), CPU under load {fmt(sched['load_cpu_s'], '.1f')}"
        f" s, idle CPU {fmt(sched['idle_cpu_s'], '.3f')} s over {sched['idle_cpu_window_s']:.0f} s",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in report["checks"].items()),
    ]
    for e in report["failure_examples"]:
        lines += [f"  FAILED {e['kind']} ({e['status']}): {e['failure']}", f"    request: {e['request'][:400]}",
                  f"    reply: {e['reply'][:400]}"]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Soak flags, and the server flags after `--`."""
    own, server_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server, http://127.0.0.1:PORT (default: start one)")
    p.add_argument("--server-pid", type=int, help="with --url: its main process (default: the port's listener)")
    p.add_argument("--model-path", help="for the server started here (default: the embedded model)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, help="stop after this many requests (default: no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="a request unanswered this long is hung")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=160)
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--idle-cpu-limit", type=float, default=0.5, help="CPU seconds the idle scheduler may use in 3 s")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--server-log", type=Path, help="where the started server logs (default: a temp file)")
    p.add_argument("--output", type=Path, help="write the report as JSON here")
    args = p.parse_args(own)
    if args.url and (args.model_path or server_flags):
        p.error("--url targets a running server: --model-path and server flags are for the one soak.py starts")
    return args, server_flags


def main(argv: list[str] | None = None) -> int:
    args, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    server = None
    if args.url:
        url = loopback_url(args.url)
        pid = args.server_pid or listener_pid(urlsplit(url).port)
    else:
        log = args.server_log or Path(tempfile.mkstemp(prefix="soak_server_", suffix=".log")[1])
        server = OwnServer(args.model_path, server_flags, log, args.startup_timeout)
        print(f"[soak] starting the server on {server.url} (log: {log})", file=sys.stderr, flush=True)
        server.wait_healthy()
        url, pid = server.url, server.proc.pid
    config = SoakConfig(
        url=url, clients=args.clients, duration_s=args.duration, max_requests=args.max_requests, seed=args.seed,
        request_timeout_s=args.request_timeout, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, drain_timeout_s=args.drain_timeout,
        idle_cpu_limit_s=args.idle_cpu_limit,
    )
    try:
        report = asyncio.run(run_soak(config, pid))
    finally:
        if server is not None:
            server.stop()
    print(format_report(report))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
