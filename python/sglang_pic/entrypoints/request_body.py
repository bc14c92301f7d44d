"""Request bodies parsed by one JSON parser on every route, so a malformed body is refused in the same words
wherever it is sent (native routes and /v1 alike), with the parser's own account of where the JSON breaks."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request

MALFORMED_JSON = "malformed JSON body"


async def read_json(request: Request) -> Any:
    """The body's JSON value; ValueError `malformed JSON body: <what and where>` when it is not JSON."""
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{MALFORMED_JSON}: {e}") from None


async def read_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; ValueError naming the problem otherwise."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body
