"""``aiprof run [options] -- CMD...``: run CMD with the agent preloaded in its Python processes.

With capture options (``--skip 10 --iterations 5``, ``--duration-ms 2000``) every process that
trains captures once; without them the agents wait for ``aiprof trigger``. Exits with CMD's
exit code.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from aiprof.cli.capture_options import add_capture_options, has_capture_options, request_from_args
from aiprof.cli.server_options import add_server_options, agent_server_config

if TYPE_CHECKING:
    from aiprof.protocol import CaptureRequest


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run a command with the capture agent preloaded",
                              description=__doc__.splitlines()[0])
    add_capture_options(p, wait_default=None)
    p.add_argument("--auto", nargs="?", const="{}", default=None, metavar="JSON",
                   help="auto-trigger: capture when steps slow down by 20%%, snapshot stacks when no step ends for "
                        "300 s; JSON overrides settings, e.g. '{\"slowdown_ratio\": 1.5, \"gap_s\": 60}' "
                        "(docs/findings.md, auto-trigger); outputs go to --out")
    add_server_options(p, "job id the agents register under (default: torchrun run id, SLURM job, "
                          "rendezvous address; sets $AIPROF_JOB)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command to run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aiprof.attach.launch import StderrTail, list_rank_dirs, run_with_agent

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    req = request_from_args(args)
    capture = has_capture_options(args)
    if args.auto is not None:
        import json
        import os

        from aiprof.errors import UsageError

        try:
            auto = json.loads(args.auto)
        except ValueError as exc:
            raise UsageError(f"--auto: not a JSON object ({exc})") from None
        if not isinstance(auto, dict):
            raise UsageError("--auto: not a JSON object")
        auto.setdefault("out", req.out)
        os.environ["AIPROF_AUTO"] = json.dumps(auto)  # the agent of every rank reads it
    server = agent_server_config(args, req.out)  # --server: agents register, heartbeat, upload
    if server:
        import sys as _sys

        from aiprof.server.client import ServerClient, ServerError

        try:
            ServerClient(server["url"], server["token"], timeout=3.0).get("info")
        except ServerError as exc:  # the job runs anyway; its agents keep trying
            print(f"aiprof: warning: server not reachable now ({exc}); agents will keep trying", file=_sys.stderr)
    tail = StderrTail() if capture else None
    rc = run_with_agent(cmd, req if capture else None, entry=args.entry, server=server, stderr_tail=tail)
    if capture:
        dirs = list_rank_dirs(req.out, req.capture_id)
        if dirs:
            print(f"aiprof: capture {req.capture_id}: " + ", ".join(dirs), file=sys.stderr)
        else:
            print(no_capture_message(rc, req, tail.lines() if tail else [], tail.failures if tail else []),
                  file=sys.stderr)
    return rc


def no_capture_message(rc: int, req: "CaptureRequest", tail: list[str], failures: list[str] | None = None) -> str:
    """Why no capture was written: the job failed (its exit status and the end of its stderr), its
    agents could not capture (``failures``: their reasons, e.g. another profiler already on), or it
    finished without reaching the iterations asked for."""
    where = f"{req.out}/{req.capture_id}"
    if rc == 0 and failures:
        return f"aiprof: no capture: the job ran, but the capture failed: {'; '.join(failures)}"
    if req.iterations is not None:
        need = f"--skip {req.skip} + {req.iterations} iteration(s)"
    else:
        need = f"--skip {req.skip} iteration(s) then {req.duration_ms} ms"
    if rc != 0:
        said = ("; the end of its stderr:" + "".join(f"\n  | {line}" for line in tail)) if tail else \
            " (it wrote nothing to stderr)"
        return f"aiprof: no capture: the command exited {rc} before its capture ({need}) was written to {where}{said}"
    return (f"aiprof: no capture: the command exited 0 before reaching {need}: nothing was written to {where} "
            "(an iteration is an optimizer.step() or an --entry call; fewer ran, or torch was never imported)")
