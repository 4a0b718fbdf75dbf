"""The HTTP front of ``aiprof server`` and ``aiprof ui`` under hostile clients (issue 31).

- A connection must finish a request's headers within HEADER_TIMEOUT_S of their first byte,
  and a fresh connection that sends nothing is closed after the keep-alive timeout: idle,
  half-sent headers (slowloris) cannot pile up. uvicorn times out neither.
- Open connections are capped below the file-descriptor limit; at the cap, the connection
  that has waited longest for a request's headers is closed to make room (a client that
  sends its request at once never waits that long), and only when none waits is the new one
  refused. Without this, 24,000 idle sockets exhausted the server's descriptors.
- A response's head and body leave in one send (CoalescingTransport).
- Error logs are rate-limited: a flood of one failure is a few lines and a count, not 161 MB.
- ``aiprof ui`` answers only requests addressed to a loopback name or the bound address
  (DNS rebinding), and binding every interface is said on stderr.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import socket
import sys
import time
from typing import Any, Callable

from uvicorn.protocols.http.auto import AutoHTTPProtocol

# A client sends a request's headers (a few hundred bytes) in one write; a slow link takes
# milliseconds. Ten seconds is generous and bounds what a drip-feeding client holds.
HEADER_TIMEOUT_S = 10.0
# Open connections: enough for every agent of a 1,024-rank job uploading while the UI is used,
# with room; the descriptor limit lowers it (FD_RESERVE kept for files, logs and children).
MAX_CONNECTIONS = 4096
FD_RESERVE = 256
# Error log lines of one kind (logger + message template) per LOG_WINDOW_S; the rest are counted.
LOG_BURST = 5
LOG_WINDOW_S = 60.0
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def raise_fd_limit() -> int:
    """Lift this process's soft descriptor limit to the hard one; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(max_connections: int = MAX_CONNECTIONS) -> int:
    soft = raise_fd_limit()
    return max(16, min(max_connections, soft - FD_RESERVE))


class CoalescingTransport:
    """A connection's transport whose writes within one turn of the event loop leave in one send:
    uvicorn writes a response's head and its body separately, two syscalls and two wake-ups of
    the client on loopback (half of the event loop's time under 1,024 agents went to send()).
    Everything but writing is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(cap: int) -> type:
    """uvicorn's HTTP protocol class with the header timeout and the connection cap."""

    class Guarded(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            # connections waiting for a request's headers, oldest first (shared by the server's protocols)
            waiting: dict = getattr(self.server_state, "aiprof_waiting", None)  # type: ignore[assignment]
            if waiting is None:
                waiting = self.server_state.aiprof_waiting = {}  # type: ignore[attr-defined]
            self._waiting = waiting
            self._header_timer: asyncio.TimerHandle | None = None
            full = len(self.connections) >= cap
            super().connection_made(transport)
            self.transport = CoalescingTransport(transport, self.loop)  # type: ignore[assignment]
            if full:
                victim = next((p for p in waiting if not p.transport.is_closing()), None)
                if victim is None:  # every connection is busy with a request: refuse this one
                    transport.abort()
                    return
                victim._drop()
            waiting[self] = None
            # uvicorn arms the keep-alive timer only after a response: a fresh silent connection gets it now
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._drop)

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._idle():
                self._waiting.pop(self, None)
                if self._header_timer is not None:
                    self._header_timer.cancel()
                    self._header_timer = None
            elif self._header_timer is None and not self.transport.is_closing():
                # the first bytes of a request, its headers not complete: their clock starts now
                # (a request whose headers came in one piece, as nearly all do, needs no timer)
                self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._drop)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._idle() and not self.transport.is_closing():
                self._waiting[self] = None  # waits for the next request: last in line to be dropped

        def connection_lost(self, exc: Exception | None) -> None:
            self._waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _drop(self) -> None:
            """Close a connection that is not in a request (its headers never completed)."""
            self._waiting.pop(self, None)
            if self._idle() and not self.transport.is_closing():
                self.transport.abort()  # RST: no lingering FIN_WAIT state for a hostile peer

    return Guarded


class RateLimit(logging.Filter):
    """At most LOG_BURST records of one kind per LOG_WINDOW_S; then one line with the count."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self.seen: dict[tuple, list] = {}  # kind -> [window start, records in it, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        st = self.seen.get(key)
        if st is None or now - st[0] > self.window_s:
            if st is not None and st[2]:
                record.msg = f"{record.msg} (and {st[2]} more like it in the last {self.window_s:.0f} s, not logged)"
            if len(self.seen) > 1000:  # bounded: old kinds are forgotten
                self.seen.clear()
            self.seen[key] = [now, 1, 0]
            return True
        st[1] += 1
        if st[1] <= self.burst:
            return True
        if st[1] == self.burst + 1:
            record.msg = f"{record.msg} (more like this in the next {self.window_s:.0f} s are counted, not logged)"
            record.exc_info = None
            record.exc_text = None
            return True
        st[2] += 1
        return False


def limit_error_logs() -> None:
    """Rate-limit the loggers a flood of bad connections writes to (asyncio's accept errors,
    uvicorn's per-connection errors and tracebacks)."""
    f = RateLimit()
    for name in ("asyncio", "uvicorn.error", "uvicorn"):
        lg = logging.getLogger(name)
        if not any(isinstance(x, RateLimit) for x in lg.filters):
            lg.addFilter(f)


def uvicorn_options(cap: int | None = None) -> dict[str, Any]:
    """What serve_app gives uvicorn: the guarded protocol (and the logs limited)."""
    limit_error_logs()
    return {"http": guarded_protocol(cap if cap is not None else connection_cap())}


def warn_if_all_interfaces(host: str, what: str) -> None:
    """One line on stderr when ``host`` binds every interface."""
    if host.strip("[]") in WILDCARDS:
        print(f"aiprof: warning: --host {host or '0.0.0.0'} listens on every network interface: {what}; "
              "the address printed below is this machine's own", file=sys.stderr, flush=True)


def allowed_hosts(bound: str) -> set[str]:
    """Host names ``aiprof ui`` answers to: loopback names and the bound address (for a wildcard
    bind, this machine's names and addresses too)."""
    names = {*LOOPBACK_NAMES, bound.strip("[]").lower()}
    if bound.strip("[]") in WILDCARDS:
        for n in (socket.gethostname(), socket.getfqdn()):
            names.add(n.lower())
            try:
                names.update(ai[4][0] for ai in socket.getaddrinfo(n, None))
            except OSError:
                pass
    names.discard("")
    return names


def _host_name(raw: str) -> str:
    """``name[:port]`` or ``[v6]:port`` -> the name, lower case."""
    raw = raw.strip().lower()
    if raw.startswith("["):
        return raw[1:raw.find("]")] if "]" in raw else raw
    return raw.rsplit(":", 1)[0] if raw.count(":") == 1 else raw


class HostCheck:
    """ASGI middleware: 421 unless the Host header names an allowed host (DNS rebinding: a page
    of another site that resolves its name to 127.0.0.1 sends its own name as Host)."""

    def __init__(self, app: Callable, hosts: set[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
            if _host_name(host) not in self.hosts:
                body = b'{"error": "this server answers to localhost only (Host header not allowed)"}'
                await send({"type": "http.response.start", "status": 421,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
