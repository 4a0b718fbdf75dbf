"""Ingest benchmark: aiprof vs HolisticTraceAnalysis on a large, realistic Kineto trace.

Builds a trace of about ``--size-mb`` MB by replicating the profiled steps of a real H200 GPT-2
trace (tests/data/gpt2_train_stall.json.gz): every copy is shifted in time past the previous
one and gets fresh ids (correlation, External id, Python id, flow id, step number), so it looks
like one long capture. Then, each in a fresh process so that peak RSS is its own:

- aiprof: ``open_capture(path, use_cache=False)`` (parse + build tables + write the Parquet store)
- HTA:    ``TraceAnalysis(trace_dir=...)`` (parse + build its DataFrames)
- aiprof re-open of the cached store: ``open_capture`` alone, and with every table loaded

and prints MB/s, peak RSS and the ratios. Usage::

    python bench/ingest.py                 # ~1 GB trace, both tools
    python bench/ingest.py --size-mb 200 --skip-hta
    python bench/ingest.py --trace bench/out/bench_1000mb.json --skip-hta   # a trace made before (--keep)
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "data" / "gpt2_train_stall.json.gz"
_ID_ARGS = ("External id", "correlation", "Python id", "Python parent id", "Ev Idx", "Record function id")


def _dump_event(e: dict) -> str:
    """Kineto's layout: one event per block at indent 2 (what torch.profiler writes)."""
    body = json.dumps(e, separators=(", ", ": "))
    return "  " + body[0] + "\n    " + body[1:-1] + "\n  }"


def generate(out: Path, size_mb: int) -> dict:
    """Write a ~size_mb MB trace to ``out`` by replicating the source's steps."""
    with gzip.open(SOURCE) as f:
        doc = json.load(f)
    events = doc.pop("traceEvents")
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    body = [e for e in events if e.get("ph") != "M" and "ts" in e and lo <= float(e["ts"]) <= hi
            and isinstance(e.get("pid"), int)]
    meta_events = [e for e in events if e.get("ph") == "M"]
    span = hi - lo + 1000.0
    max_id = 1 + max([int(e.get("id", 0)) for e in body if isinstance(e.get("id"), int)] +
                     [int(v) for e in body for k, v in (e.get("args") or {}).items() if k in _ID_ARGS and isinstance(v, int)])
    nsteps = len(steps)
    doc.setdefault("distributedInfo", {"backend": "nccl", "rank": 0, "world_size": 1})
    header = json.dumps({k: v for k, v in doc.items() if k != "traceName"}, indent=2)[:-2]
    target = size_mb * 1_000_000
    copies = 0
    events_written = 0
    with open(out, "w") as f:
        f.write(header + ',\n  "traceEvents": [\n')
        first = True
        for e in meta_events:
            f.write(("" if first else ",\n") + _dump_event(e))
            first = False
        while f.tell() < target:
            dt = copies * span
            did = copies * max_id
            for e in body:
                c = dict(e)
                c["ts"] = round(float(e["ts"]) + dt, 3)
                if isinstance(e.get("id"), int):
                    c["id"] = e["id"] + did
                args = e.get("args")
                if args:
                    a = dict(args)
                    for k in _ID_ARGS:
                        if isinstance(a.get(k), int) and a[k] > 0:
                            a[k] += did
                    c["args"] = a
                if c.get("name", "").startswith("ProfilerStep#"):
                    c["name"] = f"ProfilerStep#{int(c['name'].split('#')[1]) + copies * nsteps}"
                f.write(",\n" + _dump_event(c))
            events_written += len(body)
            copies += 1
        f.write('\n  ],\n  "traceName": "bench"\n}\n')
    return {"copies": copies, "events": events_written + len(meta_events), "bytes": out.stat().st_size}


def _child(kind: str, path: str) -> None:
    """Run one measurement in this (fresh) process and print a JSON line."""
    t0 = time.perf_counter()
    extra = {}
    if kind == "aiprof":
        from aiprof.trace.store import open_capture

        cap = open_capture([path], use_cache=False, show_progress=False)
        extra["rows"] = cap.ranks[0].meta["rows"]
    elif kind == "aiprof-reopen":
        from aiprof.trace.store import open_capture

        cap = open_capture([path], show_progress=False)
        extra["open_s"] = time.perf_counter() - t0
        rt = cap.ranks[0]
        for name in rt.meta["rows"]:
            rt.table(name)
    elif kind == "hta":
        import logging

        logging.disable(logging.WARNING)
        from hta.trace_analysis import TraceAnalysis

        d = tempfile.mkdtemp(prefix="hta-")
        os.symlink(path, os.path.join(d, "rank-0.json"))
        ta = TraceAnalysis(trace_dir=d)
        extra["rows"] = {"events": int(len(ta.t.get_trace(0)))}
    else:
        raise SystemExit(f"unknown kind {kind}")
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"kind": kind, "wall_s": wall, "peak_rss": rss, **extra}))


def _measure(kind: str, path: Path, workers: int = 0) -> dict:
    env = dict(os.environ)
    if workers:
        env["AIPROF_INGEST_WORKERS"] = str(workers)
    res = subprocess.run([sys.executable, __file__, "--child", kind, str(path)], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1000, help="size of the generated JSON (default 1000)")
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out"), help="where to write the trace")
    ap.add_argument("--skip-hta", action="store_true", help="measure aiprof only")
    ap.add_argument("--keep", action="store_true", help="keep the generated trace")
    ap.add_argument("--trace", help="measure this trace (e.g. one kept from an earlier run) instead of generating one")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    if args.trace:
        trace = Path(args.trace)
        info = {"bytes": trace.stat().st_size}
        mb = info["bytes"] / 1e6
        print(f"trace {trace} : {mb:,.0f} MB", flush=True)
        args.keep = True  # never delete a trace we did not make
    else:
        trace = d / f"bench_{args.size_mb}mb.json"
        t = time.perf_counter()
        info = generate(trace, args.size_mb)
        mb = info["bytes"] / 1e6
        print(f"generated {trace} : {mb:,.0f} MB, {info['events']:,} events ({info['copies']} copies of 5 steps) "
              f"in {time.perf_counter() - t:.1f} s", flush=True)
    store = Path(str(trace) + ".aiprof")
    shutil.rmtree(store, ignore_errors=True)
    rows = []
    a1 = _measure("aiprof", trace, workers=1)
    rows.append(("aiprof ingest, 1 process", a1))
    print(f"aiprof rows: {a1['rows']}", flush=True)
    shutil.rmtree(store, ignore_errors=True)
    a2 = _measure("aiprof", trace, workers=2)
    rows.append(("aiprof ingest, 2 processes", a2))
    ro = _measure("aiprof-reopen", trace)
    rows.append(("aiprof re-open (all tables)", ro))
    h = None
    if not args.skip_hta:
        h = _measure("hta", trace)
        rows.append(("HTA TraceAnalysis", h))
    print(f"\n{'':30s} {'wall s':>8s} {'MB/s':>8s} {'peak RSS MB':>12s} {'RSS / JSON':>10s}")
    for name, r in rows:
        print(f"{name:30s} {r['wall_s']:8.2f} {mb / r['wall_s']:8.1f} {r['peak_rss'] / 1e6:12.0f} {r['peak_rss'] / info['bytes']:10.2f}")
    print(f"\naiprof re-open of the cached store (meta only): {ro['open_s']:.3f} s; with every table loaded: {ro['wall_s']:.3f} s")
    if h:
        for name, r in rows[:2]:
            print(f"{name}: throughput {h['wall_s'] / r['wall_s']:.1f}x HTA's, peak RSS {r['peak_rss'] / h['peak_rss']:.2f}x HTA's")
    if not args.keep:
        trace.unlink()
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
