"""`aiprof diff PATH [--base STEP] [--compare STEP]` and `aiprof diff A B`: what a slower step
(or capture) spent its extra time on."""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from aiprof.analysis.diff import diff_captures, diff_steps
from aiprof.cli import gates
from aiprof.cli.inputs import add_capture_option
from aiprof.errors import UsageError
from aiprof.report import json_report, text
from aiprof.trace.store import open_capture


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="explain the time difference between two steps or two captures",
                       description="Diff two steps of one trace (default: the median step vs the slowest), or "
                                   "the median steps of two traces A and B. Root items (kernels, copies, and "
                                   "GPU-idle gaps attributed to what the host was doing) are ranked by their "
                                   "contribution to the time difference.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="one trace (steps of it) or two traces A B")
    p.add_argument("--base", type=int, metavar="STEP", help="base step number (default: the median step)")
    p.add_argument("--compare", type=int, metavar="STEP", help="compared step number (default: the slowest step; "
                                                               "with two traces: B's median step)")
    p.add_argument("--rank", type=int, help="rank to diff when a trace holds several ranks (default: the first)")
    p.add_argument("--top", type=int, default=20, help="how many items to list (default 20)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--no-cache", action="store_true", help="re-parse even when a cached store exists")
    p.add_argument("--fail-if-slower", type=float, metavar="PCT",
                   help=f"CI gate, with two traces A B: exit {gates.GATE_EXIT} (after printing the diff) when B's "
                        "median step (the step closest to the median step time) is more than PCT %% slower than "
                        "A's (default: never)")
    add_capture_option(p)
    p.set_defaults(func=run)


def _pick(cap, rank):
    if rank is None:
        return cap.ranks[0]
    try:
        return cap.rank(rank)
    except KeyError:
        raise UsageError(f"no rank {rank} (ranks: {', '.join(str(r.rank) for r in cap.ranks)})") from None


def run(args: argparse.Namespace) -> int:
    if len(args.paths) > 2:
        raise UsageError("diff takes one trace (two of its steps) or two traces (A B)")
    if args.fail_if_slower is not None:
        if len(args.paths) != 2:
            raise UsageError("--fail-if-slower compares two captures: give A (the baseline) and B")
        if args.fail_if_slower < 0:
            raise UsageError(f"--fail-if-slower takes a percentage >= 0, not {args.fail_if_slower:g}")
    if len(args.paths) == 1:
        rt = _pick(open_capture(args.paths, use_cache=not args.no_cache, capture=args.capture), args.rank)
        d = diff_steps(rt, args.base, args.compare, top=args.top)
    else:
        a = _pick(open_capture([args.paths[0]], use_cache=not args.no_cache, capture=args.capture), args.rank)
        b = _pick(open_capture([args.paths[1]], use_cache=not args.no_cache, capture=args.capture), args.rank)
        d = diff_captures(a, b, args.base, args.compare, top=args.top)
    out = {"schema": "aiprof.diff/1", **asdict(d)}
    if args.json:
        sys.stdout.write(json_report.dumps(out) + "\n")
    else:
        text.render_diff(out)
    if args.fail_if_slower is not None:
        # --base/--compare pick other steps than the medians: the message names them as such
        which = "median step" if args.base is None and args.compare is None else "compared step"
        why = gates.fail_if_slower_message(out, args.fail_if_slower, which)
        if why:
            print(f"aiprof: {why}", file=sys.stderr)
            return gates.GATE_EXIT
    return 0
