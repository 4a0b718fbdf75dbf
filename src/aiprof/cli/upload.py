"""``aiprof upload [--server URL] DIR...``: send local captures to the central service.

DIR is an ``--out`` folder, one capture folder or one rank folder. Sent: every trace capture
(rank folder with a meta.json) marked ``.pending-upload`` (its job's upload did not finish:
server down, job exited), and, with ``--all``, also those never marked (captures made without
``--server``); never one already uploaded to that server. Uploads are resumable and
SHA-256 checked as the agents' are (docs/server.md, "Uploads"). The server defaults to
``$AIPROF_SERVER``, else the one named in the pending markers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from aiprof.cli.server_options import add_server_options, server_token
from aiprof.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("upload", help="upload local captures (pending ones) to the aiprof server",
                              description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", metavar="DIR", help="--out folder, capture folder or rank folder")
    p.add_argument("--all", action="store_true", help="also captures never marked for upload (made without --server)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    add_server_options(p, "job id for captures whose marker names none")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aiprof.agent import outbox
    from aiprof.server.client import ServerClient, ServerError

    for d in args.dirs:
        if not os.path.isdir(d):
            raise UsageError(f"{d}: no such folder")
    todo: list[outbox.RankDir] = []
    for d in args.dirs:
        for path in outbox.rank_dirs(d):
            rd = outbox.describe(path)
            if rd is None or not outbox.is_capture(path):
                continue
            if os.path.isfile(os.path.join(path, outbox.PENDING)) or args.all:
                todo.append(rd)
    url = args.server or next((rd.server for rd in todo if rd.server), None)
    if not url:
        raise UsageError("no server: --server URL or $AIPROF_SERVER (no pending marker names one)")
    client = ServerClient(url, server_token(args), timeout=15.0)
    todo = [rd for rd in todo if outbox.uploaded_to(rd.path) != client.base]
    results = []
    failed = 0
    for rd in todo:
        rd.job = rd.job or args.job
        try:
            files = outbox.upload_rank_dir(client, rd)
            results.append({"dir": rd.path, "capture_id": rd.capture_id, "rank": rd.rank, "ok": True,
                            "files": len(files), "bytes_sent": sum(f.sent for f in files)})
        except ServerError as exc:
            failed += 1
            results.append({"dir": rd.path, "capture_id": rd.capture_id, "rank": rd.rank, "ok": False,
                            "error": str(exc)})
    if args.json:
        print(json.dumps({"server": client.base, "results": results}, indent=1))
    else:
        if not results:
            print(f"nothing to upload to {client.base}", file=sys.stderr)
        for r in results:
            if r["ok"]:
                print(f"{r['dir']}: uploaded as {r['capture_id']} rank {r['rank']} ({r['files']} files, "
                      f"{r['bytes_sent']} bytes sent)")
            else:
                print(f"{r['dir']}: failed: {r['error']}")
        if results and not failed:
            print(f"captures: {client.base}/", file=sys.stderr)
    return 1 if failed else 0
