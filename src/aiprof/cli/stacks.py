"""``aiprof stacks PID|NAME... [--json] [--native]``: dump the Python (and native) stacks of processes."""
from __future__ import annotations

import argparse
import json

from aiprof.errors import AiprofError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("stacks", help="dump Python stacks of running processes (py-spy)",
                              description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="+", metavar="PID|NAME", help="process ids or names (matched against command lines)")
    p.add_argument("--json", action="store_true", help="one JSON document: a list of processes with threads and frames")
    p.add_argument("--native", action="store_true", help="include native (C/C++) frames where py-spy can unwind them")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per process (default 20)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aiprof.attach.procs import resolve_targets
    from aiprof.attach.stacks import dump_stacks, format_text

    pids = resolve_targets(args.targets)
    dumps = dump_stacks(pids, native=args.native, timeout=args.timeout)
    if len(dumps) == 1 and not dumps[0]["ok"]:
        raise AiprofError(f"pid {dumps[0]['pid']}: {dumps[0]['error']}")
    if args.json:
        print(json.dumps(dumps, indent=1))
    else:
        print(format_text(dumps), end="")
    return 0 if all(d["ok"] for d in dumps) else 1
