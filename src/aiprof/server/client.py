"""Client of the aiprof service API, standard library only.

Used by the agent inside users' jobs (which may have no third-party HTTP library, and must not
import one), by ``aiprof trigger --server`` and by the load benchmark. Every call has a timeout;
errors are :class:`ServerError` (connection refused, timeout, HTTP status >= 400).

Uploads are streamed from disk, checksummed (SHA-256 over the whole file, checked by the
server before the file becomes visible) and resumable: the client asks how many bytes the
server already holds and sends the rest (see docs/server.md, "Uploads").
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, BinaryIO

API = "/api/v1"
TOKEN_HEADER = "Authorization"
DEFAULT_TIMEOUT_S = 10.0
UPLOAD_BLOCK = 1 << 20
# keep_alive: a connection idle longer than this is not reused (the server keeps one 30 s)
KEEP_ALIVE_IDLE_S = 10.0
# the errors of a kept connection the server closed before reading the request
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
# capture ids, job ids, file names: what the server accepts (server/store.py) and the agent sends
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_plain_name(name: object) -> bool:
    """True for a name the server accepts: letters, digits, '.', '_', '-', at most 128, no '..'."""
    return isinstance(name, str) and bool(NAME_RE.match(name)) and ".." not in name


class ServerError(Exception):
    """A call that failed: ``status`` is the HTTP status, or None when the server was unreachable."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def file_sha256(path: str) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a file, read in blocks."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(UPLOAD_BLOCK)
            if not b:
                break
            h.update(b)
            n += len(b)
    return h.hexdigest(), n


class _Window:
    """A file object that reads at most ``length`` bytes of ``f`` (http.client streams it)."""

    def __init__(self, f: BinaryIO, length: int) -> None:
        self.f, self.left = f, length

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        n = self.left if n is None or n < 0 else min(n, self.left)
        b = self.f.read(min(n, UPLOAD_BLOCK))
        self.left -= len(b)
        return b


@dataclass
class UploadResult:
    """What one file upload did: bytes sent in this call (after resume), attempts, final sha."""

    name: str
    size: int
    sha256: str
    sent: int
    attempts: int
    resumed_from: int


class ServerClient:
    """One service endpoint plus its token. Thread-safe: every call opens its own connection, or
    with ``keep_alive`` each thread keeps one open (HTTP/1.1 keep-alive) while it calls at least
    every KEEP_ALIVE_IDLE_S: no TCP handshake and teardown per call, on either side (a third
    of a heartbeat's cost). A kept connection the server has closed is replaced once, for a
    request whose body can be sent again; use it for calls that may be repeated (an agent's)."""

    def __init__(self, url: str, token: str | None, timeout: float = DEFAULT_TIMEOUT_S, keep_alive: bool = False) -> None:
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"server URL must be http(s)://HOST:PORT, not {url!r}")
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.base = f"{u.scheme}://{self.host}:{self.port}"
        self.token = token
        self.timeout = timeout
        self.keep_alive = keep_alive
        self._local = threading.local()  # keep_alive: each thread's open connection and when it was last used

    def _conn(self, timeout: float | None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.timeout, blocksize=1 << 16)

    def _open(self, timeout: float | None) -> tuple[http.client.HTTPConnection, bool]:
        """A connection for one call, and whether it was used before (kept open by this thread)."""
        if not self.keep_alive:
            return self._conn(timeout), False
        conn = getattr(self._local, "conn", None)
        if (conn is not None and conn.sock is not None
                and time.monotonic() - getattr(self._local, "used", float("-inf")) < KEEP_ALIVE_IDLE_S):
            conn.timeout = timeout or self.timeout
            conn.sock.settimeout(conn.timeout)
            return conn, True
        self._drop()
        conn = self._local.conn = self._conn(timeout)
        return conn, False

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close this thread's kept connection (keep_alive), if any."""
        self._drop()

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.token:
            h[TOKEN_HEADER] = f"Bearer {self.token}"
        h.update(extra or {})
        return h

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                query: dict[str, Any] | None = None, raw: Any = None, headers: dict[str, str] | None = None) -> Any:
        """One call; JSON in (``body``) or bytes/file (``raw``), JSON out. Raises ServerError."""
        url = path if path.startswith("/") else f"{API}/{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        hdr = self._headers(headers)
        data = raw
        if body is not None:
            data = json.dumps(body, default=str).encode()
            hdr["Content-Type"] = "application/json"
        while True:
            conn, reused = self._open(timeout)
            try:
                conn.request(method, url, body=data, headers=hdr)
                resp = conn.getresponse()
                payload = resp.read(16 << 20)
                status = resp.status
            except (OSError, http.client.HTTPException) as exc:
                if conn is getattr(self._local, "conn", None):
                    self._drop()
                else:
                    conn.close()
                # a kept connection the server closed meanwhile (restarted, at its connection cap;
                # uvicorn closes only connections between requests): sent again once, on a new one
                if reused and isinstance(exc, STALE) and (data is None or isinstance(data, bytes)):
                    continue
                raise ServerError(f"{self.base}: {type(exc).__name__}: {exc}") from None
            if self.keep_alive and resp.isclosed() and not resp.will_close:
                self._local.used = time.monotonic()  # read to its end: the next call of this thread reuses it
            elif conn is getattr(self._local, "conn", None):
                self._drop()
            else:
                conn.close()
            break
        try:
            out = json.loads(payload) if payload else None
        except ValueError:
            out = payload.decode(errors="replace")
        if status >= 400:
            msg = out.get("error") if isinstance(out, dict) else str(out)[:200]
            raise ServerError(f"{method} {url.split('?')[0]}: HTTP {status}: {msg}", status, out)
        return out

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, body if body is not None else {}, **kw)

    # -- uploads --------------------------------------------------------------------------------
    @staticmethod
    def file_path(capture_id: str, rank: int, name: str) -> str:
        q = urllib.parse.quote
        return f"{API}/captures/{q(capture_id, safe='')}/ranks/{int(rank)}/files/{q(name, safe='')}"

    def upload_file(self, capture_id: str, rank: int, path: str, name: str | None = None,
                    attempts: int = 5, backoff_s: float = 0.5, timeout: float = 60.0,
                    sha: tuple[str, int] | None = None, job: str | None = None,
                    world_size: int | None = None, scope: str | None = None) -> UploadResult:
        """Upload one file, resuming where the server's partial copy ends; retried with backoff.

        The server keeps the file only when its SHA-256 matches ``sha256``; on a mismatch it
        drops its partial copy and the next attempt starts over. ``job`` names the job of a
        capture the server did not trigger itself, ``world_size`` and ``scope`` ("rank": taken by
        this rank alone) the ranks it has, so the server refuses a rank outside them.
        """
        name = name or os.path.basename(path)
        digest, size = sha or file_sha256(path)
        fpath = self.file_path(capture_id, rank, name)
        sent = 0
        first_offset = -1
        last: Exception | None = None
        # a file of at most one block is sent whole at once: the server checks what it holds of it
        # with the PUT itself (one request, not two; a 409 says what it holds). A larger one, and
        # any retry, asks first and resumes from there.
        ask = size > UPLOAD_BLOCK
        for attempt in range(1, attempts + 1):
            try:
                if ask or attempt > 1:
                    st = self.get(fpath, timeout=timeout)
                    if st.get("complete") and st.get("sha256") == digest:
                        return UploadResult(name, size, digest, sent, attempt, max(first_offset, 0))
                    offset = int(st.get("received") or 0)
                else:
                    offset = 0
                if offset > size:
                    offset = 0
                if first_offset < 0:
                    first_offset = offset
                with open(path, "rb") as f:
                    f.seek(offset)
                    res = self.request("PUT", fpath, raw=_Window(f, size - offset), timeout=timeout,
                                       query={"offset": offset, "size": size, "sha256": digest, "job": job,
                                              "world_size": world_size, "scope": scope},
                                       headers={"Content-Type": "application/octet-stream",
                                                "Content-Length": str(size - offset)})
                sent += size - offset
                if res.get("complete"):
                    return UploadResult(name, size, digest, sent, attempt, max(first_offset, 0))
                last = ServerError(f"upload of {name} incomplete: server holds {res.get('received')} of {size} bytes")
            except ServerError as exc:
                last = exc
                if exc.status is not None and exc.status in (400, 401, 403, 404, 413):
                    raise  # retrying cannot help
                if (exc.status == 409 and isinstance(exc.body, dict) and "received" in exc.body
                        and not exc.body.get("busy")):
                    if not ask and attempt == 1:
                        first_offset = -1  # that PUT sent from 0 without asking: where it resumes is told next
                    continue  # the server holds other bytes than we sent from: ask it, resume at once
            except OSError as exc:  # the local file vanished or cannot be read
                raise ServerError(f"cannot read {path}: {exc}") from None
            time.sleep(min(backoff_s * (2 ** (attempt - 1)), 10.0))
        assert last is not None
        raise last


def wait_reachable(url: str, token: str | None, timeout: float) -> bool:
    """True once ``GET /api/v1/health`` answers within ``timeout`` seconds."""
    c = ServerClient(url, token, timeout=2.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c.get("health")
            return True
        except ServerError:
            time.sleep(0.1)
        except socket.timeout:
            time.sleep(0.1)
    return False
