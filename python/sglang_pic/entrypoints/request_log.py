"""One log line per HTTP request, written when its answer is complete: method, route, status, latency and, for a
generation, its rid and token counts; for a refusal, the error message it got.

This is what SGLang's server prints per request through uvicorn's access log, with what an operator asks next
(how much of the prompt was cached, how much of it was spans). Prompts and outputs stay out of the log unless
--log-requests asks for them (SGLang's flag, off by default there too), in the detail of --log-requests-level.
The routes that routers and Prometheus poll (QUIET_PATHS) log at DEBUG while they succeed, so they do not drown
the requests.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq

logger = logging.getLogger(__name__)

RECORD_KEY = "sglang_pic.request_record"
QUIET_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/get_load"})
CLIENT_LEFT = 499  # nginx's status for a client that hung up before the answer began
MAX_ERROR_BODY = 4096  # bytes of an error answer kept to find its message in
PARTIAL_CHARS = 2048  # --log-requests-level 2 cuts each prompt and output to this many characters, as SGLang does


@dataclass
class RequestRecord:
    """What one request's line says beyond method, route, status and latency, filled in as its route learns it."""

    rid: str | None = None
    prompt_tokens: int | None = None
    span_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    inputs: GenerateReqInput | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def note_prepared(self, obj: GenerateReqInput, reqs: list[TokenizedGenerateReq]) -> None:
        """The prompts as tokenized: their tokens, and how many of those are span text (in spans or their
        recomputed runs)."""
        self.inputs = obj
        self.rid = reqs[0].rid if len(reqs) == 1 else f"{reqs[0].rid} (+{len(reqs) - 1})"
        self.prompt_tokens = sum(req.prompt_len for req in reqs)
        self.span_tokens = sum(
            len(seg.tokens) if seg.kind == "span" else sum(n for _, n in seg.span_runs)
            for req in reqs
            for seg in req.segments
        )

    def note_finished(self, outs: list[dict[str, Any]]) -> None:
        """Finished outputs: their cache hits and generated tokens add up over the request's prompts and choices."""
        self.outputs.extend(outs)
        metas = [out["meta_info"] for out in outs]
        self.cached_tokens = (self.cached_tokens or 0) + sum(m["cached_tokens"] for m in metas)
        self.completion_tokens = (self.completion_tokens or 0) + sum(m["completion_tokens"] for m in metas)

    def line(self, method: str, path: str, status: int, seconds: float, detail: int | None) -> str:
        """The log line; `detail`: --log-requests-level when --log-requests is on, else None."""
        parts = [f"{method} {path} {status} {seconds:.3f}s"]
        counts = {
            "rid": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "span_tokens": self.span_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
        }
        parts += [f"{name}={value}" for name, value in counts.items() if value is not None]
        if self.error is not None:
            parts.append(f"error={json.dumps(self.error)}")
        if detail is not None and self.inputs is not None:
            parts += self._contents(detail)
        return " ".join(parts)

    def _contents(self, detail: int) -> list[str]:
        """SGLang's levels: 0 nothing more, 1 the sampling params, 2 also prompts and outputs cut to PARTIAL_CHARS
        characters each, 3 them whole."""
        if detail < 1:
            return []
        parts = [f"sampling_params={json.dumps(self.inputs.sampling_params)}"]
        if detail >= 2:
            limit = None if detail >= 3 else PARTIAL_CHARS
            prompt = self.inputs.text if self.inputs.text is not None else self.inputs.input_ids
            parts.append(f"input={_cut(json.dumps(prompt), limit)}")
            if self.outputs:
                texts = [out["text"] for out in self.outputs]
                parts.append(f"output={_cut(json.dumps(texts[0] if len(texts) == 1 else texts), limit)}")
        return parts


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else f"{text[:limit]}...({len(text) - limit} more)"


def request_record(request: Request) -> RequestRecord:
    """The record of `request`'s line; a detached one where no RequestLogMiddleware runs (an app built bare)."""
    record = request.scope.get("state", {}).get(RECORD_KEY)
    return record if record is not None else RequestRecord()


def error_message(body: bytes) -> str:
    """The message of an error answer: `error.message` of either API's JSON error shape, else the body's text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, TypeError, KeyError):
        return body.decode(errors="replace").strip()


class RequestLogMiddleware:
    """Plain ASGI (streams pass through untouched); installed outermost, so the API key's 401s and FastAPI's own
    404s and 405s get their line too. A stream's line is written when its last event has gone."""

    def __init__(self, app: ASGIApp, detail: int | None) -> None:
        self.app = app
        self.detail = detail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord()
        scope.setdefault("state", {})[RECORD_KEY] = record
        start = time.perf_counter()
        status: int | None = None
        error_body = bytearray()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                error_body.extend(message.get("body", b"")[: MAX_ERROR_BODY - len(error_body)])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            status, record.error = status or 500, f"{type(e).__name__}: {e}"
            raise
        finally:
            if status is None:
                status = CLIENT_LEFT
            if error_body and record.error is None:
                record.error = error_message(bytes(error_body))
            level = logging.DEBUG if scope["path"] in QUIET_PATHS and status < 400 else logging.INFO
            if logger.isEnabledFor(level):
                seconds = time.perf_counter() - start
                logger.log(level, record.line(scope["method"], scope["path"], status, seconds, self.detail))
