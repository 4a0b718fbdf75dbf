"""JSON over HTTP for the service and the UI app: errors as ``{"error": ...}``, bounded bodies."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from aiprof.protocol import RequestError
from aiprof.server.store import BadName

MAX_JSON = 1 << 20  # request bodies other than uploads
# Longest wait for the next piece of a request's body. A client on a working link sends its next
# 64 KiB (the client's block) in well under a second; one that stalls holds its request (and an
# upload's per-file lock) this long at most.
BODY_IDLE_TIMEOUT_S = 15.0


class BodyTimeout(Exception):
    """The client stopped sending its request body for BODY_IDLE_TIMEOUT_S."""


async def body_chunks(req: Request, idle_s: float | None = None) -> AsyncIterator[bytes]:
    """``req.stream()`` with a bound on the wait for each piece (BodyTimeout past it)."""
    it = req.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), idle_s or BODY_IDLE_TIMEOUT_S)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise BodyTimeout() from None
        yield chunk


class HTTPError(Exception):
    """An answer other than 2xx: ``status``, a message, and extra JSON fields for the client."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.extra = status, extra


def error_response(message: str, status: int, **extra: Any) -> JSONResponse:
    """``{"error": message, ...}`` with ``status``: the one error shape of every JSON route."""
    # 408: the client stalled mid-request; closing is the only way to end its half-sent body
    headers = {"connection": "close"} if status == 408 else None
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


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
    try:
        async for chunk in body_chunks(req):
            buf += chunk
            if len(buf) > limit:
                raise HTTPError(413, f"request body over {limit} bytes")
    except BodyTimeout:
        raise HTTPError(408, f"no request body for {BODY_IDLE_TIMEOUT_S:g} s") from None
    except ClientDisconnect:  # nobody reads the answer; no traceback in the log either
        raise HTTPError(400, "client disconnected during the request body") from None
    if not buf:
        return {}
    try:
        obj = json.loads(buf)
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    except RecursionError:  # 1 MiB of "[": the parser recurses once per level
        raise HTTPError(400, "body nests too deeply to be a request") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "body must be a JSON object")
    return obj
