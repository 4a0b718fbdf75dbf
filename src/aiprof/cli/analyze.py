"""`aiprof analyze PATH...`: ingest traces (cached) and print the report."""
from __future__ import annotations

import argparse
import io
import os
import sys

from aiprof.analysis.report import build_report
from aiprof.report import json_report, text
from aiprof.trace.store import open_capture


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="analyse traces or a capture directory and print the report",
                       description="Analyse torch.profiler/Kineto traces (.json, .json.gz; one per rank, "
                                   "or a capture directory) and report steps, GPU time breakdown, "
                                   "kernels and the causes of lost time.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace file(s) or capture directory")
    p.add_argument("--json", action="store_true", help="print the JSON report (schema aiprof.report/2) instead of text")
    p.add_argument("--out", metavar="DIR", help="also write report.json and report.txt into DIR")
    p.add_argument("--html", metavar="FILE", help="also write the UI's overview as one self-contained HTML file")
    p.add_argument("--entry", metavar="NAME", help="function/annotation that marks one iteration "
                                                  "(when the trace has no ProfilerStep)")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list (default 15)")
    p.add_argument("--no-cache", action="store_true", help="re-parse even when a cached store exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cap = open_capture(args.paths, use_cache=not args.no_cache)
    report = build_report(cap, entry=args.entry, top=args.top)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json_report.write(report, os.path.join(args.out, "report.json"))
        buf = io.StringIO()
        text.render(report, file=buf)
        with open(os.path.join(args.out, "report.txt"), "w") as f:
            f.write(buf.getvalue())
    if args.html:
        from aiprof.server.static_report import write as write_html

        write_html(cap, args.html, report=report, entry=args.entry)
    if args.json:
        sys.stdout.write(json_report.dumps(report) + "\n")
    else:
        text.render(report)
        if args.out:
            print(f"\nwrote {os.path.join(args.out, 'report.json')} and report.txt")
        if args.html:
            print(f"wrote {args.html}")
    return 0
