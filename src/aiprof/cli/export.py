"""`aiprof export CAPTURE... --format perfetto|chrome|speedscope|folded -o FILE`."""
from __future__ import annotations

import argparse
import json
import sys

from aiprof.cli.inputs import add_capture_option
from aiprof.errors import AiprofError, UsageError
from aiprof.export.files import atomic_open

FORMATS = ("perfetto", "chrome", "speedscope", "folded")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a capture's timeline (Perfetto, Chrome JSON) or stacks",
                       description="perfetto: protobuf trace for ui.perfetto.dev (ranks = processes, streams = "
                                   "tracks, counters, steps); chrome: trace-event JSON (.gz to compress); "
                                   "speedscope: GPU and CPU flame graphs per rank; folded: GPU stacks.")
    p.add_argument("paths", nargs="+", metavar="CAPTURE", help="trace file(s) or capture directory")
    p.add_argument("--format", choices=FORMATS, default="perfetto",
                   help="perfetto (protobuf .pftrace), chrome (trace-event JSON with flow arrows; .gz compresses), "
                        "speedscope (GPU and CPU graphs per rank) or folded (default perfetto)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="output file (written whole or not at all)")
    p.add_argument("--rank", type=int, help="only this rank (default: every rank; a chrome file of one rank "
                                            "reads back into aiprof analyze)")
    p.add_argument("--no-host", action="store_true", help="timeline formats: GPU, steps and counters only")
    p.add_argument("--what", choices=("gpu", "cpu"), default="gpu", help="folded: which graph (default gpu)")
    p.add_argument("--no-findings", action="store_true", help="timeline formats: skip the track of causes "
                   "(saves running the analyses)")
    p.add_argument("--no-cache", action="store_true", help="re-parse even when a cached store exists")
    add_capture_option(p)
    p.set_defaults(func=run)


def _marks(cap, args: argparse.Namespace):
    if args.no_findings:
        return None
    from aiprof.export.marks import marks_from_report
    from aiprof.scale.job_report import capture_report

    return marks_from_report(capture_report(cap))


def run(args: argparse.Namespace) -> int:
    from aiprof.cli.flame import refuse_empty
    from aiprof.flame import lacks
    from aiprof.trace.store import open_capture

    if args.format == "perfetto":
        from aiprof.export import perfetto

        perfetto._pb2()
    cap = open_capture(args.paths, use_cache=not args.no_cache, capture=args.capture)
    if args.rank is not None:
        from aiprof.trace.store import Capture

        try:
            cap = Capture(ranks=[cap.rank(args.rank)])
        except KeyError:
            raise UsageError(f"no rank {args.rank} (ranks: {', '.join(str(r.rank) for r in cap.ranks)})") from None
    if args.format in ("perfetto", "chrome"):
        why = lacks.timeline_empty_reason(cap, host=not args.no_host)
        if why:
            raise AiprofError(why)
        for note in lacks.timeline_notes(cap, host=not args.no_host):
            print(f"aiprof: note: {note}", file=sys.stderr)
    if args.format == "perfetto":
        st = perfetto.export(cap, args.output, marks=_marks(cap, args), host=not args.no_host)
        print(f"wrote {args.output}: {sum(st.slices.values()):,} slices, {st.counters:,} counter values, "
              f"{st.tracks} tracks, {st.bytes / 1e6:.1f} MB", file=sys.stderr)
    elif args.format == "chrome":
        from aiprof.export import chrome

        st = chrome.export(cap, args.output, marks=_marks(cap, args), host=not args.no_host)
        print(f"wrote {args.output}: {st.events:,} events, {st.flows:,} flow arrows", file=sys.stderr)
    else:
        from aiprof.flame import folded, speedscope, stacks

        if args.format == "folded":
            prof = stacks.build(cap, args.what)
            if not prof.stacks:
                raise AiprofError(f"nothing to export: {lacks.empty_graph_reason(cap, args.what)}")
            with atomic_open(args.output, "w") as f:
                n = folded.write(prof, f)
            print(f"wrote {args.output}: {n} stacks", file=sys.stderr)
        else:
            profs = []
            for rt in cap.ranks:
                fo = stacks.host_forest(rt)
                profs += [stacks.gpu_profile(rt, forest=fo), stacks.cpu_profile(rt, forest=fo)]
            refuse_empty([f"{p.name} graph: {lacks.empty_graph_reason(cap, p.meta.get('what', 'gpu'), p.meta.get('rank'))}"
                          for p in profs if not p.stacks], len(profs))
            with atomic_open(args.output, "w") as f:
                json.dump(speedscope.document(profs), f)
            print(f"wrote {args.output}: {len(profs)} profiles", file=sys.stderr)
    return 0
