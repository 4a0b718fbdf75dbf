"""`aiprof ui CAPTURE_OR_TRACE...`: serve the web UI over a capture (binds 127.0.0.1 by default)."""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any, Callable

from aiprof.cli.inputs import add_capture_option
from aiprof.errors import AiprofError, UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="open the web UI (dashboard, steps, tables, ranks, timeline, flame, memory)",
                       description="Serve a local web UI over a capture directory or trace files "
                                   "(one per rank). Open the printed URL in a browser.")
    p.add_argument("paths", nargs="+", metavar="CAPTURE_OR_TRACE", help="capture directory or trace file(s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8642, help="port (default 8642; 0 picks a free one)")
    p.add_argument("--entry", metavar="NAME", help="function/annotation that marks one iteration")
    p.add_argument("--memory-snapshot", metavar="FILE",
                   help="a torch.cuda.memory._snapshot() pickle (.pickle or .pickle.gz) for the Memory page")
    p.add_argument("--open", action="store_true", help="open the UI in the default browser")
    p.add_argument("--no-cache", action="store_true", help="re-parse even when a cached store exists")
    add_capture_option(p)
    p.set_defaults(func=run)


def _check_bind(host: str, port: int) -> None:
    """Fail early, with one line, when the address is taken (before ingesting anything)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: {exc.strerror}") from None
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise AiprofError(f"cannot serve on {host}:{port}: {exc.strerror}") from None


def serve_app(app: Any, host: str, port: int, on_started: Callable[[str], None], **uvicorn_kw: Any) -> None:
    """Serve ``app`` with uvicorn until Ctrl-C; ``on_started(url)`` runs once it listens.

    ``url`` is ``http://HOST:PORT`` with the port actually bound (``--port 0``) and 127.0.0.1
    for a wildcard address. One line (AiprofError) when it cannot bind. Hostile clients are
    bounded by aiprof.server.netguard.
    """
    import uvicorn

    from aiprof.server.netguard import connection_cap, guarded_protocol, limit_error_logs

    uvicorn_kw.setdefault("http", guarded_protocol(connection_cap()))  # header timeout, connection cap
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           **uvicorn_kw))
    limit_error_logs()  # after uvicorn has configured its loggers

    def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            threading.Event().wait(0.05)
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        on_started(f"http://{shown}:{bound}")

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run()
    except (OSError, SystemExit) as exc:  # uvicorn exits when it cannot bind
        raise AiprofError(f"cannot serve on {host}:{port}: {getattr(exc, 'strerror', None) or 'bind failed'}") from None
    if not server.started:
        raise AiprofError(f"cannot serve on {host}:{port} (address in use?)")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401  (the 'ui' extra)

        from aiprof.server.app import create_app, static_built
    except ModuleNotFoundError as exc:
        raise AiprofError(f"the web UI needs the 'ui' extra ({exc.name} is missing): pip install 'aiprof[ui]'") from None
    from aiprof.server.data import CaptureData
    from aiprof.trace.store import open_capture

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, not {args.port}")
    if args.memory_snapshot and not os.path.isfile(args.memory_snapshot):
        raise UsageError(f"--memory-snapshot {args.memory_snapshot}: no such file")
    _check_bind(args.host, args.port)
    from aiprof.server.netguard import HostCheck, allowed_hosts, warn_if_all_interfaces

    warn_if_all_interfaces(args.host, "the UI has no login, so anyone who can reach this port can read the capture")
    cap = open_capture(args.paths, use_cache=not args.no_cache, capture=args.capture)
    data = CaptureData(cap, entry=args.entry, memory_snapshot=args.memory_snapshot)
    if not static_built():
        print("aiprof: warning: the UI's front end is not built (run `make setup`); only /api works", file=sys.stderr)
    # analyse in the background so the first page is quick; requests wait on the same memo
    threading.Thread(target=data.report, daemon=True).start()

    def announce(url: str) -> None:
        print(f"aiprof ui: serving {len(cap.ranks)} rank(s) on {url}/  (Ctrl-C stops)", flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(url + "/")

    # no login, so only requests addressed to this machine's loopback names (DNS rebinding)
    serve_app(HostCheck(create_app(data), allowed_hosts(args.host)), args.host, args.port, announce)
    return 0
