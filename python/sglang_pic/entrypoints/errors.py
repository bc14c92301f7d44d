"""Error bodies in the shape each API's clients read, picked by the request's path.

SGLang's native routes answer `{"error": {"message": ...}}`, as SGLang's http_server does for a bad /generate; the
OpenAI routes (/v1/...) answer OpenAI's `{"error": {"message", "type", "param", "code"}}`. Routes served under both
names (/tokenize and /v1/tokenize) and FastAPI's own answers (unknown route, wrong method, a failed parameter
validation, an unhandled exception) follow the same rule instead of FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from sglang_pic.entrypoints.openai_protocol import describe_errors
from sglang_pic.entrypoints.openai_responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"

# The OpenAI SDK's exception names, which OpenAI-compatible servers put in `type`.
_OPENAI_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def native_error(message: str, status: int = 400, headers: Mapping[str, str] | None = None) -> Response:
    body = orjson.dumps({"error": {"message": message}})
    return Response(body, status, headers=headers, media_type="application/json")


def openai_error(
    message: str, status: int = 400, param: str | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    err_type = _OPENAI_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return Response(body.model_dump_json(), status, headers=headers, media_type="application/json")


def error_response(
    path: str, message: str, status: int = 400, param: str | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    """The error in the shape of the API that `path` belongs to (`param`: the offending field, for OpenAI's)."""
    if path.startswith(OPENAI_PREFIX):
        return openai_error(message, status, param, headers)
    return native_error(message, status, headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route FastAPI's own errors through `error_response`. A failed parameter validation is a 400, as in SGLang."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"{exc.detail}: {request.method} {request.url.path}"
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            message += f" (allowed: {exc.headers['Allow']})"
        return error_response(request.url.path, message, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_errors(list(exc.errors()))
        return error_response(request.url.path, message, 400, param)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, f"internal server error: {type(exc).__name__}: {exc}", 500)
