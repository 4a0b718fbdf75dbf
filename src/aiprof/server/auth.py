"""The service's token: created at first start (DATA/token, mode 0600), required on every call.

Agents and the CLI send ``Authorization: Bearer <token>``. A browser logs in once by opening
any page with ``?token=<token>``: the server answers with an HttpOnly, SameSite=Strict cookie
and redirects to the same page without the token. The cookie is accepted for GET requests of
the web UI only; the ``/api/v1`` API (which changes state) takes the header alone, so another
site cannot make a logged-in browser trigger captures.
"""
from __future__ import annotations

import hmac
import os
import secrets
from typing import Any, Awaitable, Callable

COOKIE = "aiprof_token"
TOKEN_FILE = "token"
OPEN_PATHS = ("/api/v1/health",)  # liveness only: says nothing but "ok"


def load_or_create_token(data_dir: str) -> str:
    """The token in ``DATA/token``; a new random one (0600) if the file does not exist."""
    path = os.path.join(data_dir, TOKEN_FILE)
    try:
        with open(path) as f:
            tok = f.read().strip()
        if tok:
            if os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)  # tighten a copy made with a loose umask
            return tok
    except FileNotFoundError:
        pass
    tok = secrets.token_urlsafe(32)
    while tok.startswith("-"):  # `--token -abc` would read as an option (1 token in 64 did)
        tok = secrets.token_urlsafe(32)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tok + "\n")
    os.replace(path + ".tmp", path)
    return tok


# a token file that group or other can read (or write) is refused, as ssh refuses such a key
TOKEN_FILE_FOREIGN_BITS = 0o077


def read_token_file(path: str, what: str) -> str:
    """The token in ``path`` (``what`` names where the path came from in errors).

    Raises :class:`~aiprof.errors.UsageError` with one line: unreadable, empty, or readable by
    other users (the token is the service's only secret)."""
    from aiprof.errors import UsageError

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_mode & TOKEN_FILE_FOREIGN_BITS:
            raise UsageError(f"{what} {path}: mode {st.st_mode & 0o777:04o} lets other users read the token; "
                             f"chmod 600 {path}")
        tok = f.read(4096).strip()
    if not tok:
        raise UsageError(f"{what} {path}: empty")
    return tok


def find_token(explicit: str | None = None, data_dir: str | None = None, token_file: str | None = None) -> str | None:
    """The token for a client: ``--token``, ``--token-file``, ``$AIPROF_TOKEN``,
    ``$AIPROF_TOKEN_FILE``, or DATA/token. A named token file that cannot be used raises
    :class:`~aiprof.errors.UsageError` (one line)."""
    if explicit:
        return explicit
    if token_file:
        return read_token_file(token_file, "--token-file")
    if os.environ.get("AIPROF_TOKEN"):
        return os.environ["AIPROF_TOKEN"]
    if os.environ.get("AIPROF_TOKEN_FILE"):
        return read_token_file(os.environ["AIPROF_TOKEN_FILE"], "$AIPROF_TOKEN_FILE")
    try:
        with open(os.path.join(data_dir or default_data_dir(), TOKEN_FILE)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def default_data_dir() -> str:
    """``$AIPROF_DATA`` or ~/.local/share/aiprof/server."""
    env = os.environ.get("AIPROF_DATA")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "aiprof", "server")


Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class TokenAuth:
    """ASGI middleware: 401 unless the request carries the token (header, or cookie for UI GETs)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def _ok(self, value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), self.token)  # type: ignore[union-attr]

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers", [])
        auth = next((v.decode("latin-1") for k, v in raw if k.lower() == b"authorization"), "")
        if auth.startswith("Bearer ") and self._ok(auth[7:].strip()):  # every agent's call: no other header read
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        is_ui_get = scope.get("method") in ("GET", "HEAD") and not path.startswith("/api/v1/")
        if is_ui_get:
            from urllib.parse import parse_qs, urlencode

            qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            given = (qs.get("token") or [None])[0]
            if self._ok(given):  # log in: set the cookie, drop the token from the address bar
                rest = urlencode({k: v for k, v in qs.items() if k != "token"}, doseq=True)
                await _send(send, 303, b"", [(b"location", (local_path(path) + ("?" + rest if rest else "")).encode()),
                                             (b"set-cookie", f"{COOKIE}={self.token.decode()}; HttpOnly; "
                                                             "SameSite=Strict; Path=/".encode())])
                return
            cookies = _cookies(headers.get("cookie", ""))
            if self._ok(cookies.get(COOKIE)):
                await self.app(scope, receive, send)
                return
        await _send(send, 401, b'{"error": "missing or wrong token (Authorization: Bearer <DATA/token>)"}',
                    [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")])


def local_path(path: str) -> str:
    """``path`` as a redirect target on this server: quoted (no header injection), one leading
    slash (``//evil.example/`` and ``/\\evil.example`` are other sites to a browser)."""
    from urllib.parse import quote

    return "/" + quote(path, safe="/%:@!$&'()*+,;=-._~").lstrip("/")


def _cookies(raw: str) -> dict[str, str]:
    out = {}
    for part in raw.split(";"):
        k, _, v = part.strip().partition("=")
        if k:
            out[k] = v
    return out


async def _send(send: Callable, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
