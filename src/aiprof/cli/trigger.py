"""``aiprof trigger [options]``: ask every agent on this host to capture, wait for the outputs.

Agents are those of jobs started with ``aiprof run`` or attached with ``aiprof attach``.
``--list`` only shows them.
"""
from __future__ import annotations

import argparse
import json
import sys

from aiprof.cli.capture_options import add_capture_options, request_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trigger", help="ask running agents on this host to capture",
                              description=__doc__.splitlines()[0])
    add_capture_options(p, wait_default=5000)
    p.add_argument("--pid", type=int, action="append", default=None, help="only this agent (repeatable)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the outputs (default 120)")
    p.add_argument("--list", action="store_true", help="list the agents and their state, capture nothing")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run)


def print_results(results: dict[int, dict], as_json: bool, req_id: str) -> int:
    """Print one line per process; returns 0 if all succeeded, else 1."""
    if as_json:
        print(json.dumps({"capture_id": req_id, "results": {str(k): v for k, v in results.items()}}, indent=1))
    else:
        for pid, r in sorted(results.items()):
            if r.get("ok"):
                print(f"pid {pid}: {r.get('dir')}  (iterations {r.get('steps')})")
            else:
                print(f"pid {pid}: failed: {r.get('error')}")
    return 0 if results and all(r.get("ok") for r in results.values()) else 1


def run(args: argparse.Namespace) -> int:
    from aiprof.attach.trigger import find_agents, trigger

    if args.list:
        agents = find_agents(args.pid)
        if args.json:
            print(json.dumps([a.status for a in agents], indent=1, default=str))
        elif not agents:
            print("no agents running", file=sys.stderr)
        for a in agents if not args.json else []:
            s = a.status
            print(f"pid {s['pid']} rank {s.get('rank')}/{s.get('world_size')} {s.get('state')} "
                  f"steps={s.get('steps')} step_ms={s.get('step_ms')} source={s.get('source')} origin={s.get('origin')}")
        return 0
    req = request_from_args(args)
    results = trigger(req, args.pid, args.timeout)
    return print_results(results, args.json, req.capture_id)
