"""`aiprof export CAPTURE... --format perfetto|chrome|speedscope|folded -o FILE`."""
from __future__ import annotations

import argparse
import json
import sys

from aiprof.export.files import atomic_open

FORMATS = ("perfetto", "chrome", "speedscope", "folded")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a capture's timeline (Perfetto, Chrome JSON) or stacks",
                       description="perfetto: protobuf trace for ui.perfetto.dev (ranks = processes, streams = "
                                   "tracks, counters, steps); chrome: trace-event JSON (.gz to compress); "
                                   "speedscope: GPU and CPU flame graphs per rank; folded: GPU stacks.")
    p.add_argument("paths", nargs="+", metavar="CAPTURE", help="trace file(s) or capture directory")
    p.add_argument("--format", choices=FORMATS, default="perfetto")
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    p.add_argument("--no-host", action="store_true", help="timeline formats: GPU, steps and counters only")
    p.add_argument("--what", choices=("gpu", "cpu"), default="gpu", help="folded: which graph (default gpu)")
    p.add_argument("--no-findings", action="store_true", help="timeline formats: skip the track of causes "
                   "(saves running the analyses)")
    p.add_argument("--no-cache", action="store_true", help="re-parse even when a cached store exists")
    p.set_defaults(func=run)


def _marks(cap, args: argparse.Namespace):
    if args.no_findings:
        return None
    from aiprof.pipeline import build_report
    from aiprof.export.marks import marks_from_report

    return marks_from_report(build_report(cap))


def run(args: argparse.Namespace) -> int:
    from aiprof.trace.store import open_capture

    if args.format == "perfetto":
        from aiprof.export import perfetto

        perfetto._pb2()
    cap = open_capture(args.paths, use_cache=not args.no_cache)
    if args.format == "perfetto":
        st = perfetto.export(cap, args.output, marks=_marks(cap, args), host=not args.no_host)
        print(f"wrote {args.output}: {sum(st.slices.values()):,} slices, {st.counters:,} counter values, "
              f"{st.tracks} tracks, {st.bytes / 1e6:.1f} MB", file=sys.stderr)
    elif args.format == "chrome":
        from aiprof.export import chrome

        n = chrome.export(cap, args.output, marks=_marks(cap, args), host=not args.no_host)
        print(f"wrote {args.output}: {n:,} events", file=sys.stderr)
    else:
        from aiprof.flame import folded, speedscope, stacks

        if args.format == "folded":
            prof = stacks.build(cap, args.what)
            with atomic_open(args.output, "w") as f:
                n = folded.write(prof, f)
            print(f"wrote {args.output}: {n} stacks", file=sys.stderr)
        else:
            profs = []
            for rt in cap.ranks:
                fo = stacks.host_forest(rt)
                profs += [stacks.gpu_profile(rt, forest=fo), stacks.cpu_profile(rt, forest=fo)]
            with atomic_open(args.output, "w") as f:
                json.dump(speedscope.document(profs), f)
            print(f"wrote {args.output}: {len(profs)} profiles", file=sys.stderr)
    return 0
