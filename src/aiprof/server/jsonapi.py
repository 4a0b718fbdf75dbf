"""JSON over HTTP for the service and the UI app: errors as ``{"error": ...}``, bounded bodies."""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from aiprof.protocol import RequestError
from aiprof.server.store import BadName

T = TypeVar("T")
MAX_JSON = 1 << 20  # request bodies other than uploads
# Longest wait for the next piece of a request's body. A client on a working link sends its next
# 64 KiB (the client's block) in well under a second; one that stalls holds its request (and an
# upload's per-file lock) this long at most.
BODY_IDLE_TIMEOUT_S = 15.0


class BodyTimeout(Exception):
    """The client stopped sending its request body for BODY_IDLE_TIMEOUT_S."""


if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[T], timeout: float) -> T:
        """``await aw``, bounded: asyncio.TimeoutError past ``timeout`` seconds. A timer on this
        task, where asyncio.wait_for (3.10) runs ``aw`` as a task of its own (~30 us more)."""
        async with asyncio.timeout(timeout):
            return await aw
else:  # pragma: no cover - Python 3.10
    within = asyncio.wait_for


class _IdleWatch:
    """The idle bound of one request body: one timer for the whole body (re-armed only when it
    comes due), not one per piece. While the body is awaited and no piece came for ``idle``
    seconds, the task is cancelled (body_chunks makes that a BodyTimeout); time the consumer
    spends with a piece (writing it) does not count."""

    def __init__(self, idle: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.idle = idle
        self.since = self.loop.time()
        self.waiting = False
        self.fired = False
        self.handle = self.loop.call_at(self.since + idle, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.waiting and now - self.since >= self.idle and self.task is not None:
            self.fired = True
            self.task.cancel()
            return
        self.handle = self.loop.call_at((self.since if self.waiting else now) + self.idle, self._check)

    def close(self) -> None:
        self.handle.cancel()


async def body_chunks(req: Request, idle_s: float | None = None) -> AsyncIterator[bytes]:
    """``req.stream()`` with a bound on the wait for each piece (BodyTimeout past it). Use it
    within ``contextlib.aclosing`` when the loop may stop early (its timer ends with it)."""
    it = req.stream().__aiter__()
    watch = _IdleWatch(idle_s or BODY_IDLE_TIMEOUT_S)
    try:
        while True:
            watch.since, watch.waiting = watch.loop.time(), True
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not watch.fired:
                    raise
                uncancel = getattr(watch.task, "uncancel", None)  # 3.11+: the cancel was ours, not the task's
                if uncancel is not None:
                    uncancel()
                raise BodyTimeout() from None
            finally:
                watch.waiting = False
            yield chunk
    finally:
        watch.close()


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
    return (await read_json_body_sized(req, limit))[0]


async def read_json_body_sized(req: Request, limit: int = MAX_JSON) -> tuple[dict, int]:
    """The request's JSON object and the length of its body, read with a size bound (413 beyond it)."""
    buf = bytearray()
    try:
        async with contextlib.aclosing(body_chunks(req)) as chunks:
            async for chunk in chunks:
                buf += chunk
                if len(buf) > limit:
                    raise HTTPError(413, f"request body over {limit} bytes")
    except BodyTimeout:
        raise HTTPError(408, f"no request body for {BODY_IDLE_TIMEOUT_S:g} s") from None
    except ClientDisconnect:  # nobody reads the answer; no traceback in the log either
        raise HTTPError(400, "client disconnected during the request body") from None
    if not buf:
        return {}, 0
    try:
        obj = json.loads(buf)
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    except RecursionError:  # 1 MiB of "[": the parser recurses once per level
        raise HTTPError(400, "body nests too deeply to be a request") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "body must be a JSON object")
    return obj, len(buf)
