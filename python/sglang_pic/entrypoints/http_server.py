"""The FastAPI app: SGLang's native HTTP API (/generate and the admin routes), /metrics, and the OpenAI routes.

Bodies are parsed by hand rather than by FastAPI's models so that every bad input (malformed JSON, wrong types,
unknown fields, out-of-range values) gets SGLang's 400 body naming the problem instead of FastAPI's 422. Fields of
SGLang's request types that have no effect here are accepted at their neutral values (sglang_fields).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sglang_pic.entrypoints.errors import error_response, install_error_handlers, native_error
from sglang_pic.entrypoints.openai_api import OpenAIServing
from sglang_pic.entrypoints.request_body import read_json
from sglang_pic.entrypoints.request_log import RequestLogMiddleware, request_record
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sglang_pic.managers.profiler import PROFILE_FIELDS
from sglang_pic.managers.server_tokenizer_manager import ClientDisconnected, ServerBusy, ServerTokenizerManager
from sglang_pic.sglang_fields import (
    ABORT_FIELDS,
    START_PROFILE_FIELDS,
    UPDATE_WEIGHTS_FIELDS,
    Ignored,
    accept_fields,
)

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
ABORT_REQUEST_FIELDS = frozenset({"rid", "abort_all"})
UPDATE_WEIGHTS_REQUEST_FIELDS = frozenset({"model_path", "load_format"})
HEALTH_CHECK_TIMEOUT_S = 20.0
PUBLIC_PATHS = frozenset({"/health"})


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS), status, media_type="application/json")


async def read_fields(request: Request, known: Collection[str], ignored: Mapping[str, Ignored]) -> dict[str, Any]:
    """A JSON object body's fields in `known`; SGLang's `ignored` ones at neutral values are dropped (ValueError
    names the rest). An empty body is an empty object, as for SGLang's routes whose fields all have defaults."""
    body = await read_json(request) if await request.body() else {}
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return accept_fields(body, known, ignored)


class ApiKeyMiddleware:
    """Every route but /health needs `Authorization: Bearer <api key>`. Plain ASGI (not BaseHTTPMiddleware), so
    streaming responses and client-disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(scope["path"], "Unauthorized: invalid or missing API key", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(manager: ServerTokenizerManager) -> FastAPI:
    args = manager.server_args
    openai = OpenAIServing(manager)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        try:
            yield
        finally:
            await manager.stop()

    app = FastAPI(lifespan=lifespan)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(RequestLogMiddleware, detail=args.log_requests_level if args.log_requests else None)
    install_error_handlers(app)
    app.include_router(openai.router())

    # ---- generation ---------------------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            obj = GenerateReqInput.from_json(await read_json(request))
            reqs = manager.prepare(obj)
        except (ValueError, TypeError) as e:
            return native_error(str(e))
        except ServerBusy as e:
            return native_error(str(e), 503)
        record = request_record(request)
        record.note_prepared(obj, reqs)
        multi = obj.is_batch or len(reqs) > 1
        with_text = obj.return_text_in_logprobs
        if obj.stream:

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async with aclosing(manager.stream(reqs, with_text, request)) as outputs:
                        async for i, out in outputs:
                            if out["meta_info"]["finish_reason"] is not None:
                                record.note_finished([out])
                            if multi:
                                out = {**out, "index": i}
                            yield b"data: " + orjson.dumps(out, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"
                except ClientDisconnected:
                    return
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        try:
            outs = await manager.collect(reqs, with_text, request)
        except ClientDisconnected:
            return Response(status_code=499)
        record.note_finished(outs)
        return json_response(outs if multi else outs[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """SGLang's AbortReq: {"rid": ..., "abort_all": ...}."""
        try:
            body = await read_fields(request, ABORT_REQUEST_FIELDS, ABORT_FIELDS)
            rid, abort_all = body.get("rid") or "", body.get("abort_all") or False
            if not isinstance(rid, str) or not isinstance(abort_all, bool):
                raise ValueError("rid must be a string and abort_all a boolean")
        except ValueError as e:
            return native_error(str(e))
        manager.abort_request(rid, abort_all)
        return Response(status_code=200)

    # ---- health and information ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        healthy = await manager.health_generate(HEALTH_CHECK_TIMEOUT_S)
        return Response(status_code=200 if healthy else 503)

    async def model_info() -> Response:
        hf = manager.model_config.hf_config
        return json_response(
            {
                "model_path": args.model_path,  # SGLang's frontend picks its chat template by this path
                "tokenizer_path": args.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": hf.get("model_type"),
                "architectures": hf.get("architectures"),
            }
        )

    async def server_info() -> Response:
        snapshots = await manager.get_stats_per_replica()
        settings = args.resolved()
        states = [{**dataclasses.asdict(s), "used_tokens": s.used_tokens} for s in snapshots]  # one per dp rank
        return json_response(
            {
                **settings,
                "max_total_num_tokens": manager.max_total_num_tokens,
                "context_len": manager.context_len,
                "internal_states": states,
                "version": VERSION,
            }
        )

    async def get_load() -> Response:
        snapshots = await manager.get_stats_per_replica()
        return json_response(
            [
                {
                    "dp_rank": rank,
                    "num_reqs": snap.num_running_reqs + snap.num_waiting_reqs,
                    "num_waiting_reqs": snap.num_waiting_reqs,
                    "num_tokens": snap.used_tokens + snap.num_waiting_tokens,
                    "ts_tic": time.perf_counter(),
                }
                for rank, snap in enumerate(snapshots)
            ]
        )

    for path, handler in (
        ("/get_model_info", model_info),
        ("/model_info", model_info),
        ("/get_server_info", server_info),
        ("/server_info", server_info),
        ("/get_load", get_load),
    ):
        app.add_api_route(path, handler, methods=["GET"])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await manager.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        """SGLang's: serve another checkpoint of the same model, {"model_path": ..., "load_format": ...}; requests
        in flight finish with the old weights, new ones wait and run with the new; the cache is dropped."""
        try:
            body = await read_fields(request, UPDATE_WEIGHTS_REQUEST_FIELDS, UPDATE_WEIGHTS_FIELDS)
            if not isinstance(body.get("model_path"), str) or not isinstance(body.get("load_format") or "", str):
                raise ValueError("model_path (a string) is required, and load_format must be a string or null")
        except ValueError as e:
            message = f'{e}; the body is {{"model_path": ..., "load_format": ...}}'
            return json_response({"success": False, "message": message}, 400)
        success, message = await manager.update_weights_from_disk(body["model_path"], body.get("load_format"))
        return json_response({"success": success, "message": message}, 200 if success else 400)

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> Response:
        """SGLang's: torch.profiler over the coming steps; optional body {"output_dir", "num_steps", "activities":
        ["CPU", "GPU"], "record_shapes"} (ProfileReqInput's other fields at their defaults). Answers with where each
        replica's Chrome trace goes."""
        try:
            body = await read_fields(request, PROFILE_FIELDS, START_PROFILE_FIELDS)
        except ValueError as e:
            return native_error(str(e))
        success, messages = await manager.profile(True, {k: v for k, v in body.items() if v is not None})
        if not success:
            return native_error("; ".join(messages))
        return PlainTextResponse(f"Start profiling. Traces go to {', '.join(messages)}\n")

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        success, messages = await manager.profile(False)
        if not success:
            return native_error("; ".join(messages))
        return PlainTextResponse(f"Stop profiling. Traces written to {', '.join(messages)}\n")

    @app.post("/concate_and_append_request")
    async def concate_and_append_request(request: Request) -> Response:
        """SGLang's parallel encoding join: {"src_rids": [...], "dst_rid": ...} (managers/parallel_encoding.py)."""
        try:
            body = await read_fields(request, ("src_rids", "dst_rid"), {})
            manager.concate_and_append(body.get("src_rids"))
        except ValueError as e:
            return native_error(str(e))
        return Response(status_code=200)

    @app.post("/warm_spans")
    async def warm_spans(request: Request) -> Response:
        """Prefill spans into the cache without generating: {"spans": [text, ...]}."""
        try:
            body = await read_fields(request, ("spans",), {})
            if not isinstance(body.get("spans"), list):
                raise ValueError('the body must be {"spans": [text, ...]}')
            return json_response(await manager.warm_spans(body["spans"]))
        except ValueError as e:
            return native_error(str(e))

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = await manager.get_stats()
        return Response(manager.metrics.render(snapshot), media_type=METRICS_CONTENT_TYPE)

    return app
