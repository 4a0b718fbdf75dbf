"""``aiprof hang PID...|--name NAME|--job [--json]``: stacks of every worker, grouped; the odd ones out.

Dumps the Python stacks of all workers of a job at once (py-spy), groups them by main-thread
stack and names the outliers: the few ranks whose stacks differ from the majority (for example
all ranks in all_reduce but one in a data-loading function). ``--from FILE`` analyses a saved
snapshot (this command's --json output, or the stacks.json the agent's auto-trigger writes).
"""
from __future__ import annotations

import argparse
import json

from aiprof.errors import AiprofError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("hang", help="snapshot the stacks of a stuck job and name the outlier ranks",
                              description=__doc__.splitlines()[0])
    p.add_argument("pids", nargs="*", metavar="PID", help="worker processes (PIDs or names)")
    p.add_argument("--name", help="every Python process whose name or command line contains NAME")
    p.add_argument("--job", nargs="?", const="", default=None, metavar="KEY",
                   help="every worker of the distributed job on this host (KEY picks one of several)")
    p.add_argument("--from", dest="from_file", metavar="FILE", action="append",
                   help="analyse saved snapshot(s) instead of live processes (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"processes", "groups", "outliers", "findings"}')
    p.add_argument("--native", action="store_true", help="include native frames where py-spy can unwind them")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per process (default 20)")
    p.set_defaults(func=run)


def _load(paths: list[str]) -> dict:
    from aiprof.analysis.hang import analyse

    procs: list[dict] = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise AiprofError(f"{path}: cannot read a snapshot ({exc})") from None
        if isinstance(data, dict) and "processes" in data:
            procs += data["processes"]
        elif isinstance(data, list):
            procs += data
        else:
            raise AiprofError(f"{path}: not a snapshot (expected a list of processes or {{'processes': [...]}})")
    return analyse(procs)


def run(args: argparse.Namespace) -> int:
    from aiprof.analysis.hang import format_text

    if args.from_file:
        res = _load(args.from_file)
    else:
        from aiprof.attach.hangsnap import snapshot, targets

        pids, ranks = targets(args.pids, args.name, args.job, args.job is not None)
        res = snapshot(pids, ranks, native=args.native, timeout=args.timeout)
        if not res["groups"]:
            errs = "; ".join(f"pid {f['pid']}: {f['error']}" for f in res["failed"][:3])
            raise AiprofError(f"no stack could be read ({errs})")
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print(format_text(res), end="")
    return 0
