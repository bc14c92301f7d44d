"""One soak client's request kinds (native /generate, the OpenAI routes, constrained output, hang-ups, aborts, bad
inputs) and the weighted mix they are drawn from; each kind returns (status, failure or "", aborted)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable

from soak_http import Http
from soak_replies import (
    ANSWER_REGEX,
    ANSWER_SCHEMA,
    check_constrained,
    failure_of,
    native_final,
    openai_text,
    stream_final,
)
from soak_workload import PDEP, PDEP_ID, SSEP, TOOLS, Workload


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
            return status, failure_of(status, lambda: stream_final(events, native=True)), False
        status, raw = await self.post("/generate", body)
        return status, failure_of(status, lambda: native_final(json.loads(raw))), False

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
            check_constrained(how, out["text"], out["meta_info"]["finish_reason"]["type"] == "stop")

        return status, failure_of(status, check), False

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
            return status, failure_of(status, lambda: stream_final(events, native=False)), False
        status, raw = await self.post(path, body)
        return status, failure_of(status, lambda: openai_text(json.loads(raw))), False

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
            check_constrained("json_schema", text, reply["choices"][0]["finish_reason"] == "stop")

        return status, failure_of(status, check), False

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
        return status, failure_of(status, lambda: events or _raise("no chunk before hanging up")), False

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
        failure = failure_of(status, final)
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
