"""``--server URL`` / ``--token`` / ``--token-file`` / ``--job`` shared by ``aiprof run``, ``attach`` and ``trigger``."""
from __future__ import annotations

import argparse
import os
from typing import Any

from aiprof.errors import UsageError


def add_server_options(p: argparse.ArgumentParser, job_help: str) -> None:
    """Add the service options (defaults from $AIPROF_SERVER / $AIPROF_TOKEN / $AIPROF_JOB)."""
    g = p.add_argument_group("central service (aiprof server)")
    g.add_argument("--server", default=os.environ.get("AIPROF_SERVER"), metavar="URL",
                   help="the aiprof server, e.g. http://head-node:8643 (default $AIPROF_SERVER)")
    tok = g.add_mutually_exclusive_group()
    tok.add_argument("--token", default=None, metavar="TOKEN",
                     help="the server's token; visible to every local user in /proc/PID/cmdline: prefer "
                          "--token-file or $AIPROF_TOKEN (default $AIPROF_TOKEN, the file $AIPROF_TOKEN_FILE, "
                          "or the local server's DATA/token)")
    tok.add_argument("--token-file", default=None, metavar="FILE",
                     help="read the server's token from FILE (mode 0600: one readable by others is refused)")
    g.add_argument("--job", default=None, metavar="JOB", help=job_help)


def server_token(args: argparse.Namespace) -> str:
    """The token for ``--server``; a one-line error when there is none."""
    from aiprof.server.auth import find_token

    tok = find_token(args.token, token_file=getattr(args, "token_file", None))
    if not tok:
        raise UsageError("--server needs the server's token: --token-file, $AIPROF_TOKEN, $AIPROF_TOKEN_FILE or "
                         "--token (it is in the server's DATA/token)")
    return tok


def agent_server_config(args: argparse.Namespace, out: str) -> dict[str, Any] | None:
    """What the agents get (``AIPROF_AGENT``'s ``server``): URL, token, local out folder, job id."""
    if not args.server:
        return None
    _check_url(args.server)
    return {"url": args.server, "token": server_token(args), "out": os.path.abspath(out), "job": args.job}


def _check_url(url: str) -> None:
    from aiprof.server.client import ServerClient

    try:
        ServerClient(url, None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
