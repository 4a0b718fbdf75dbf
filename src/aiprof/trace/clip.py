"""Dropping what a trace recorded after its capture ended (an off-thread stop leaves some).

The agent ends a capture by detaching the profiler from the training thread (agent/offstop.py):
from that moment the thread records no op, but CUPTI records CUDA API calls and kernels until
the export thread finishes the profiler (after the GPU drained the captured steps' work), and
torch's Python tracer records until then on every thread. Those rows belong to the job's next
step, not to the capture: they would add a partial step to kernel counts and totals. The
agent writes the detach time in meta.json (``stop.detached_unix_ns``) with the trace clock's
offset (``clock.trace_minus_unix_us``); here host rows that start after it are dropped, and the
GPU rows launched by a dropped CUDA call (same correlation id). GPU work launched before the
detach stays, whenever it ran.
"""
from __future__ import annotations

import numpy as np

from aiprof.trace.table import Table

HOST_TABLES = ("ops", "annotations", "python", "runtime", "memory")  # native calls/syscalls: windowed by the agent
GPU_TABLES = ("kernels", "memops", "gpu_sync")  # joined to their launch by ``corr``


def capture_end_ns(capture: dict) -> int | None:
    """The capture's end on the trace clock (ns, the store's ``ts`` unit) from the agent's
    meta.json parts (trace/store.py ``read_capture_meta``); None when not an off-thread stop."""
    stop, clock = capture.get("stop"), capture.get("clock")
    if not isinstance(stop, dict) or not isinstance(clock, dict):
        return None
    t, off = stop.get("detached_unix_ns"), clock.get("trace_minus_unix_us")
    if not isinstance(t, int) or isinstance(off, bool) or not isinstance(off, (int, float)):
        return None
    return int(round(t + float(off) * 1000.0))


def _keep(tables: dict[str, Table], name: str, keep: np.ndarray) -> int:
    dropped = int(len(keep) - keep.sum())
    if dropped:
        tables[name] = tables[name].take(np.flatnonzero(keep))
    return dropped


def clip_after(tables: dict[str, Table], end_ns: int) -> int:
    """Drop, in place, the rows recorded after ``end_ns`` (see the module doc); returns how many."""
    dropped = 0
    late = np.zeros(0, np.int64)  # correlation ids of CUDA calls made after the end
    for name in HOST_TABLES:
        t = tables.get(name)
        if t is None or not len(t) or "ts" not in t:
            continue
        keep = t["ts"] <= end_ns
        if name == "runtime" and "corr" in t:
            late = t["corr"][~keep]
            late = late[late >= 0]
        dropped += _keep(tables, name, keep)
    for name in GPU_TABLES:
        t = tables.get(name)
        if t is not None and len(t) and len(late) and "corr" in t:
            dropped += _keep(tables, name, ~np.isin(t["corr"], late))
    t = tables.get("collectives")
    if t is not None and len(t):
        host = t.strings("side").isin_labels(lambda s: s == "cpu")
        gpu_late = ~host & np.isin(t["corr"], late) if len(late) and "corr" in t else np.zeros(len(t), bool)
        dropped += _keep(tables, "collectives", ~((host & (t["ts"] > end_ns)) | gpu_late))
    t = tables.get("flows")
    if t is not None and len(t) and "src_ts" in t:
        dropped += _keep(tables, "flows", t["src_ts"] <= end_ns)
    return dropped
