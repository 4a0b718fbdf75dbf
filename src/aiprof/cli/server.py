"""``aiprof server [--data DIR] [--host 127.0.0.1] [--port 8643]``: the central service.

Agents of jobs started with ``aiprof run --server URL`` register with it; ``aiprof trigger
--server URL --job JOB`` captures every rank of a job; uploads are analysed and shown in the
web UI. State lives in DATA (default ``$AIPROF_DATA`` or ~/.local/share/aiprof/server);
the token is DATA/token. docs/server.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from aiprof.errors import AiprofError, UsageError


def register(sub: argparse._SubParsersAction) -> None:
    from aiprof.server.auth import default_data_dir

    p = sub.add_parser("server", help="central service: agents, job-wide triggers, uploads, analysis, web UI",
                       description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, metavar="DIR", help=f"data folder (default {default_data_dir()})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for a cluster)")
    p.add_argument("--port", type=int, default=8643, help="port (default 8643; 0 picks a free one)")
    p.add_argument("--max-file-mb", type=int, default=4096, metavar="MB", help="largest uploaded file (default 4096)")
    from aiprof.trace.limits import add_limit_options

    add_limit_options(p)  # for the analyses of uploads: the `aiprof analyze` children inherit them
    p.add_argument("--heartbeat-s", type=float, default=1.0, metavar="S",
                   help="agents' heartbeat period (default 1 s; stretched automatically above 500 agents)")
    p.add_argument("--max-agents-per-host", type=int, default=None, metavar="N",
                   help="live agents one network address may register (default 256)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at most (default 4096, below the descriptor limit); at the cap the one "
                        "waiting longest for a request's headers is closed")
    p.add_argument("--public-url", default=None, metavar="URL", help="base URL printed in links (default: as requested)")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="analyse captures on this Ray cluster (ray://HOST:PORT; default: on this machine, "
                        "a local Ray from 17 ranks; docs/scale.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401  (the 'ui' extra)

        from aiprof.server.service import create_service
    except ModuleNotFoundError as exc:
        raise AiprofError(f"the server needs the 'ui' extra ({exc.name} is missing): pip install 'aiprof[ui]'") from None
    from aiprof.cli.ui import _check_bind, serve_app
    from aiprof.server.auth import default_data_dir
    from aiprof.server.store import write_json

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, not {args.port}")
    if args.heartbeat_s <= 0 or args.max_file_mb <= 0:
        raise UsageError("--heartbeat-s and --max-file-mb must be > 0")
    if args.max_connections is not None and args.max_connections < 16:
        raise UsageError("--max-connections must be >= 16")
    data = os.path.abspath(args.data or default_data_dir())
    try:
        os.makedirs(data, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise AiprofError(f"--data {data}: {exc.strerror}") from None
    _check_bind(args.host, args.port)
    from aiprof.server.netguard import MAX_CONNECTIONS, connection_cap, guarded_protocol, warn_if_all_interfaces

    warn_if_all_interfaces(args.host, "agents and browsers of other machines reach it with the token, over "
                                      "plain HTTP (put TLS in front on an untrusted network)")
    app, svc = create_service(data, args.max_file_mb, args.heartbeat_s, args.public_url, args.cluster)
    if args.max_agents_per_host is not None:
        if args.max_agents_per_host <= 0:
            raise UsageError("--max-agents-per-host must be > 0")
        svc.ctx.registry.max_per_address = args.max_agents_per_host

    def announce(url: str) -> None:
        write_json(os.path.join(data, "server.json"), {"url": url, "pid": os.getpid(), "data": data})
        print(f"aiprof server: {url}/  data {data}  (token in {os.path.join(data, 'token')}; "
              f"a browser logs in once with {url}/?token=<token>)", flush=True)

    try:
        serve_app(app, args.host, args.port, announce, timeout_keep_alive=30, backlog=4096,
                  http=guarded_protocol(connection_cap(args.max_connections or MAX_CONNECTIONS)))
    finally:
        try:
            os.unlink(os.path.join(data, "server.json"))
        except OSError:
            pass
    print(json.dumps({"stopped": True, **svc.stats}), file=sys.stderr)
    return 0
