"""Timeline pan/zoom response of `aiprof ui` on a generated 10 M-event capture.

Builds one rank in memory (no Kineto JSON: the point is the UI's query path): 100 steps, each
with ops on the main thread, one runtime launch inside each op, and the launched kernels spread
over 4 GPU streams. Then it times the LOD index build and a scripted session of pan and zoom
window queries at 1600 px, both in-process (`analysis.timeline.window`) and over HTTP against the
real app (uvicorn on 127.0.0.1), and prints the distribution.

    .venv/bin/python bench/ui_timeline.py [--events 10000000] [--queries 60]
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

import numpy as np

from aiprof.analysis import timeline
from aiprof.trace.store import Capture, RankTrace
from aiprof.trace.table import Strings, Table


def synthetic_rank(n_events: int, steps: int = 100, seed: int = 0) -> RankTrace:
    """~n_events events: ops (2/10), runtime launches (4/10), kernels (4/10)."""
    rng = np.random.default_rng(seed)
    n_ops = n_events // 5
    n_k = (n_events - n_ops) // 2
    per_op = n_k // n_ops  # launches per op (2)
    t0 = 1_000_000_000_000
    op_gap = 5_000  # ns per op slot
    op_ts = t0 + np.arange(n_ops, dtype=np.int64) * op_gap
    op_dur = np.full(n_ops, op_gap - 500, np.int64)
    op_names = [f"aten::op{i}" for i in range(200)]
    op_name = Strings(rng.integers(0, len(op_names), n_ops).astype(np.int32), op_names)
    # runtime launches nested inside their op
    rt_ts = (np.repeat(op_ts, per_op) + np.tile(np.arange(per_op) * 2000 + 200, n_ops)).astype(np.int64)
    rt_dur = np.full(len(rt_ts), 1500, np.int64)
    corr = np.arange(len(rt_ts), dtype=np.int64) + 1
    tid = 100
    runtime = Table({"ts": rt_ts, "dur": rt_dur, "pid": np.full(len(rt_ts), 1), "tid": np.full(len(rt_ts), tid),
                     "name": Strings(np.zeros(len(rt_ts), np.int32), ["cudaLaunchKernel"]), "corr": corr,
                     "ext_id": np.repeat(np.arange(n_ops, dtype=np.int64) + 1, per_op), "cbid": np.zeros(len(rt_ts), np.int64)})
    ops = Table({"ts": op_ts, "dur": op_dur, "pid": np.full(n_ops, 1), "tid": np.full(n_ops, tid), "name": op_name,
                 "ext_id": np.arange(n_ops, dtype=np.int64) + 1})
    # kernels: 4 streams, back to back on each, 1-40 µs
    nk = len(rt_ts)
    stream = (np.arange(nk) % 4 + 7).astype(np.int64)
    kdur = rng.integers(1_000, 40_000, nk).astype(np.int64)
    kts = np.empty(nk, np.int64)
    for s in range(4):
        m = stream == s + 7
        kts[m] = rt_ts[m][0] + 3_000 + np.concatenate([[0], np.cumsum(kdur[m][:-1])])  # back to back
    knames = [f"void kernel_{i}<float>(Params)" for i in range(300)]
    kernels = Table({"ts": kts, "dur": kdur, "device": np.zeros(nk, np.int64), "stream": stream,
                     "name": Strings(rng.integers(0, len(knames), nk).astype(np.int32), knames), "corr": corr,
                     "ext_id": np.repeat(np.arange(n_ops, dtype=np.int64) + 1, per_op), "cls": Strings(np.zeros(nk, np.int32), ["compute"])})
    # steps: ProfilerStep annotations over equal slices of the op range
    edges = np.linspace(op_ts[0] - 1000, op_ts[-1] + op_gap, steps + 1).astype(np.int64)
    ann = Table({"ts": edges[:-1], "dur": np.diff(edges) - 1, "pid": np.full(steps, 1), "tid": np.full(steps, tid),
                 "name": Strings(np.arange(steps, dtype=np.int32), [f"ProfilerStep#{i}" for i in range(steps)]),
                 "ext_id": np.zeros(steps, np.int64), "gpu": np.zeros(steps, bool)})
    tables = {"ops": ops, "runtime": runtime, "kernels": kernels, "annotations": ann}
    return RankTrace(rank=0, source="synthetic", meta={"device": 0}, _tables=tables)


def session(lo: int, hi: int, n: int, seed: int = 1) -> list[tuple[int, int]]:
    """A scripted user: from the whole trace, zoom in at random points (x0.5 a step) down to
    ~20 µs, panning 20 % after every zoom, then back to the whole trace; repeat."""
    rng = np.random.default_rng(seed)
    out, t0, t1 = [], lo, hi
    while len(out) < n:
        span = t1 - t0
        if span < 20_000:
            t0, t1 = lo, hi
        else:
            at = t0 + rng.random() * span
            t0, t1 = int(at - (at - t0) * 0.5), int(at + (t1 - at) * 0.5)
        out.append((t0, t1))
        d = int((t1 - t0) * 0.2 * (1 if rng.random() < 0.5 else -1))
        t0, t1 = t0 + d, t1 + d
        out.append((t0, t1))
    return out[:n]


def stats(ms: list[float]) -> str:
    a = np.array(ms)
    return f"p50 {np.percentile(a, 50):.1f} ms, p95 {np.percentile(a, 95):.1f} ms, max {a.max():.1f} ms (n={len(a)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--queries", type=int, default=60)
    ap.add_argument("--px", type=int, default=1600)
    args = ap.parse_args()
    t = time.perf_counter()
    rt = synthetic_rank(args.events)
    print(f"generated {sum(len(rt.table(n)) for n in ('ops', 'runtime', 'kernels', 'annotations')):,} events "
          f"in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    tl = timeline.build_index(rt)
    print(f"LOD index: {tl.events:,} events in {len(tl.lanes)} lanes, built in {time.perf_counter() - t:.1f} s "
          "(once per rank, when the Timeline page is first opened)")
    views = session(tl.start_ns, tl.end_ns, args.queries)
    inproc, sizes, drawn = [], [], []
    for a, b in views:
        t = time.perf_counter()
        w = timeline.window(tl, a, b, args.px, origin=tl.start_ns)
        inproc.append(1000 * (time.perf_counter() - t))
        drawn.append(sum(len(l["events"]["start"]) for l in w["lanes"]))
    print(f"in-process window query: {stats(inproc)}; events sent per view: median {int(np.median(drawn))}, max {max(drawn)}")

    import uvicorn

    from aiprof.server.app import create_app
    from aiprof.server.data import CaptureData

    data = CaptureData(Capture([rt]))
    server = uvicorn.Server(uvicorn.Config(create_app(data), host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}/api/timeline/"
    o = data.origin()
    json.load(urllib.request.urlopen(base + "lanes?rank=0"))
    http = []
    for a, b in views:
        t = time.perf_counter()
        body = urllib.request.urlopen(f"{base}window?rank=0&t0={a - o}&t1={b - o}&px={args.px}").read()
        json.loads(body)
        http.append(1000 * (time.perf_counter() - t))
        sizes.append(len(body))
    print(f"HTTP window request (query + JSON + transfer + parse): {stats(http)}; "
          f"response size median {int(np.median(sizes)) // 1024} KiB, max {max(sizes) // 1024} KiB")
    server.should_exit = True
    th.join(5)


if __name__ == "__main__":
    main()
