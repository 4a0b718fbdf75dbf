"""Reader throughput of a git revision against the working tree, in one process, interleaved.

The trace reader's modules (``aiprof.trace.{events,columns,builder,kineto}``) of ``--ref`` are
loaded beside the working tree's under another package name, and both read the same file in
one process (``read_trace(path, workers=1)``: parse and build the tables, no store), in
alternation, so that a shared machine's load hits both alike. Prints each run, the medians of
wall and of CPU time (this process's; less sensitive to other work on the machine), the median
of the per-pair ratios and the load average. Usage::

    python bench/ingest.py --size-mb 100 --skip-hta --keep     # makes bench/out/bench_100mb.json
    python bench/ingest_ab.py bench/out/bench_100mb.json --ref main --runs 9
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("events", "columns", "builder", "kineto")  # the reader; the rest of aiprof is shared
REF_PACKAGE = "_aiprof_ingest_ref"


def load_ref(ref: str, into: str):
    """Import ``ref``'s reader modules as package ``REF_PACKAGE`` (written under ``into``)."""
    pkg = Path(into) / REF_PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for m in MODULES:
        src = subprocess.run(["git", "show", f"{ref}:src/aiprof/trace/{m}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        for other in MODULES:
            src = src.replace(f"aiprof.trace.{other} ", f"{REF_PACKAGE}.{other} ")
        (pkg / f"{m}.py").write_text(src)
    sys.path.insert(0, into)
    import importlib

    return importlib.import_module(f"{REF_PACKAGE}.kineto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a Kineto JSON trace")
    ap.add_argument("--ref", default="main",
                    help="git revision to compare with (default main); its reader modules import the rest of "
                         "aiprof from the working tree, so pick one where that matches (e.g. the merge-base)")
    ap.add_argument("--runs", type=int, default=7, help="reads of each (default 7)")
    args = ap.parse_args()
    from aiprof.trace import kineto as new

    mb = os.path.getsize(args.trace) / 1e6
    with tempfile.TemporaryDirectory() as d:
        old = load_ref(args.ref, d)
        readers = {args.ref: old.read_trace, "working tree": new.read_trace}
        for read in readers.values():  # warm: imports, page cache, numpy's first calls
            read(args.trace, workers=1)
        times: dict[str, list[float]] = {k: [] for k in readers}
        cpu: dict[str, list[float]] = {k: [] for k in readers}
        load = [os.getloadavg()[0]]
        for i in range(args.runs):
            for name in (list(readers) if i % 2 == 0 else list(readers)[::-1]):
                gc.collect()
                t, c = time.perf_counter(), time.process_time()
                readers[name](args.trace, workers=1)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
            load.append(os.getloadavg()[0])
            print(f"run {i + 1}: " + "  ".join(f"{k} {times[k][-1]:.3f} s (CPU {cpu[k][-1]:.3f} s)" for k in readers),
                  flush=True)
    print(f"\n{args.trace}: {mb:.1f} MB, {args.runs} runs each, load average (1 min) "
          f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")
    for name, v in times.items():
        med, cmed = statistics.median(v), statistics.median(cpu[name])
        print(f"{name:14s} wall median {med:.3f} s = {mb / med:6.1f} MB/s (best {mb / min(v):.1f}); "
              f"CPU median {cmed:.3f} s = {mb / cmed:6.1f} MB/s")
    for label, d in (("wall", times), ("CPU", cpu)):
        ref, cur = d.values()
        ratio = statistics.median([a / b for a, b in zip(ref, cur)])
        print(f"speed-up ({label}), median of the per-run ratios: {ratio:.2f}x")


if __name__ == "__main__":
    main()
