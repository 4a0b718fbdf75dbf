"""JSON over HTTP for the service and the UI app: errors as ``{"error": ...}``, bounded bodies."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiprof.protocol import RequestError
from aiprof.server.store import BadName

MAX_JSON = 1 << 20  # request bodies other than uploads


class HTTPError(Exception):
    """An answer other than 2xx: ``status``, a message, and extra JSON fields for the client."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.extra = status, extra


def error_response(message: str, status: int, **extra: Any) -> JSONResponse:
    """``{"error": message, ...}`` with ``status``: the one error shape of every JSON route."""
    return JSONResponse({"error": message, **extra}, status_code=status)


def json_error(exc: Exception) -> JSONResponse:
    """The answer for a client's mistake (HTTPError, a bad name: 400, a bad capture request: 400)."""
    if isinstance(exc, HTTPError):
        return error_response(str(exc), exc.status, **exc.extra)
    if isinstance(exc, (BadName, RequestError)):
        return error_response(str(exc), 400)
    raise exc


def json_endpoint(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A route handler whose client errors become JSON answers (anything else is a 500)."""
    async def endpoint(req: Request) -> Response:
        try:
            return await fn(req)
        except (HTTPError, BadName, RequestError) as exc:
            return json_error(exc)
    return endpoint


def api_not_found(req: Request) -> Response:
    """404 for an unknown ``/api/...`` path (a JSON answer, not the UI's HTML)."""
    return error_response("no such endpoint", 404)


async def read_json_body(req: Request, limit: int = MAX_JSON) -> dict:
    """The request's JSON object, read with a size bound (413 beyond it)."""
    buf = bytearray()
    async for chunk in req.stream():
        buf += chunk
        if len(buf) > limit:
            raise HTTPError(413, f"request body over {limit} bytes")
    if not buf:
        return {}
    try:
        obj = json.loads(buf)
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "body must be a JSON object")
    return obj
