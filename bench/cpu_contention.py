"""Why per-task CPU grows with the number of tasks running at once on one host.

Runs K copies of one kind of work at once (K = 1, then each of --procs), each in its own process,
and prints the median process CPU seconds per copy and its ratio to K = 1. Kinds:

- ``python``: a pure-Python integer loop (no memory traffic): slower with K only if the cores'
  clock drops with load (turbo) or cores are shared (SMT);
- ``stream``: numpy copies of 256 MB arrays (memory bandwidth bound);
- ``ingest``: aiprof's ingest of one rank of a built capture (what a scale-out ingest task does),
  each copy writing its own store; timed the second time (the first pays the lazy imports).

    python bench/cpu_contention.py --procs 16,64 --rank /tmp/scale/ddp2_n1024/rank00000.json.gz
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context

PY_LOOP = 20_000_000
STREAM_MB = 256
STREAM_COPIES = 20


def _python(_: str) -> float:
    t = time.process_time()
    x = 0
    for i in range(PY_LOOP):
        x += i & 7
    return time.process_time() - t


def _stream(_: str) -> float:
    import numpy as np

    a = np.ones(STREAM_MB << 17)  # float64: 8 bytes each
    b = np.empty_like(a)
    t = time.process_time()
    for _ in range(STREAM_COPIES):
        np.copyto(b, a)
    return time.process_time() - t


def _ingest(rank: str) -> float:
    os.environ["AIPROF_INGEST_WORKERS"] = "1"
    from aiprof.trace.store import ingest

    d = tempfile.mkdtemp()
    try:
        src = os.path.join(d, os.path.basename(rank))
        os.symlink(rank, src)  # its store is written beside it: one per copy
        ingest(src, 0, None, False)  # once untimed: the lazy imports (pyarrow's pandas) and caches
        t = time.process_time()
        ingest(src, 0, None, False)
        return time.process_time() - t
    finally:
        shutil.rmtree(d, ignore_errors=True)


KINDS = {"python": _python, "stream": _stream, "ingest": _ingest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", default="16,64", help="copies at once, comma-separated (1 is always run first)")
    ap.add_argument("--rank", help="a trace file for the ingest kind (omit: ingest not run)")
    args = ap.parse_args()
    counts = [1] + [int(k) for k in args.procs.split(",") if k]
    kinds = [k for k in KINDS if k != "ingest" or args.rank]
    ctx = get_context("spawn")
    print(f"{os.cpu_count()} CPUs; median CPU s per copy (ratio to 1 copy)")
    for kind in kinds:
        base = None
        cells = []
        for k in counts:
            with ctx.Pool(k) as pool:
                times = pool.map(KINDS[kind], [args.rank or ""] * k, chunksize=1)
            med = statistics.median(times)
            base = base or med
            cells.append(f"{k:3d} at once {med:6.3f} ({med / base:.2f}x)")
        print(f"  {kind:7s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
