"""GPU memory: peaks and the ops that allocate most, from the trace's ``[memory]`` events
(profile_memory=True) or from a ``torch.cuda.memory._snapshot()`` pickle.
Definitions in docs/metrics.md ("Memory and FLOPs")."""
from __future__ import annotations

import io
import pickle
import zlib
from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import OP, host_tree, is_library_frame
from aiprof.errors import AiprofError
from aiprof.trace import limits
from aiprof.trace.store import RankTrace

_CUDA_DEVICE_TYPE = 1  # c10::DeviceType::CUDA in [memory] events
# allocation helpers: an allocation inside one is credited to the op that called it
_GENERIC_ALLOC_OPS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                      "aten::resize_", "aten::zeros", "aten::new_zeros", "aten::zeros_like")


@dataclass
class MemoryAnalysis:
    source: str  # "trace" | "snapshot" | "none"
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_ts_ns: int | None
    peak_step: int | None
    top_allocators: list[dict] = field(default_factory=list)  # [{"where","calls","bytes"}]


def memory_from_trace(rt: RankTrace, step_of=None, top: int = 10) -> MemoryAnalysis:
    """Peaks of allocated/reserved CUDA memory and the ops allocating the most bytes."""
    m = rt.memory
    if not len(m) or "total_allocated" not in m:
        return MemoryAnalysis("none", None, None, None, None)
    sel = m["device_type"] == _CUDA_DEVICE_TYPE if "device_type" in m else np.ones(len(m), dtype=bool)
    dev = rt.meta.get("device")
    if dev is not None and "device_id" in m:
        sel &= m["device_id"] == dev
    if not sel.any():
        return MemoryAnalysis("none", None, None, None, None)
    ts, alloc, res = m["ts"][sel], m["total_allocated"][sel], m["total_reserved"][sel]
    i = int(np.argmax(alloc))
    step = None
    if step_of is not None:
        s = int(step_of(np.array([ts[i]]))[0])
        step = s if s >= 0 else None
    # attribute allocations (bytes > 0) to the innermost enclosing op on the allocating thread
    nbytes, tid = m["bytes"][sel], m["tid"][sel]
    pos = nbytes > 0
    tree = host_tree(rt)
    where = _enclosing_op(tree, ts[pos], tid[pos])
    # aten::empty & co. only allocate on behalf of the op that called them: name that op
    generic = np.array([l.startswith(_GENERIC_ALLOC_OPS) for l in tree.labels] + [False], dtype=bool)
    for _ in range(4):
        g = (where >= 0) & generic[npx.take(tree.code, where, -1)]
        if not g.any():
            break
        up = tree.nearest(tree.parent[where[g]], OP)
        where[g] = np.where(up >= 0, up, where[g])
        if (up < 0).all():
            break
    labels = list(tree.labels) + ["(outside any op)"]
    code = npx.take(tree.code, where, len(labels) - 1)
    tot = np.bincount(code, weights=nbytes[pos], minlength=len(labels))
    cnt = np.bincount(code, minlength=len(labels))
    tops = [{"where": labels[c], "calls": int(cnt[c]), "bytes": int(tot[c])}
            for c in np.argsort(-tot)[:top] if cnt[c]]
    return MemoryAnalysis("trace", int(alloc[i]), int(res.max()), int(ts[i]), step, tops)


def _enclosing_op(tree, ts: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Innermost op node containing each (ts, tid), or -1. One pass per thread."""
    out = np.full(len(ts), -1, dtype=np.int64)
    if not len(tree) or not len(ts):
        return out
    is_op = tree.kind == OP
    for t in npx.unique(tid):
        q = np.nonzero(tid == t)[0]
        nodes = np.nonzero(is_op & (tree.tid == t))[0]
        if not len(nodes):
            continue
        s, d = tree.start[nodes], tree.depth[nodes]
        # candidates: the last op starting at or before ts; walk up its op ancestors while it
        # does not contain ts (ops nest, so a few steps suffice)
        i = np.searchsorted(s, ts[q], side="right") - 1
        cur = np.where(i >= 0, nodes[np.maximum(i, 0)], -1)
        for _ in range(int(d.max()) + 2 if len(d) else 1):
            bad = (cur >= 0) & (tree.end[np.maximum(cur, 0)] <= ts[q])
            if not bad.any():
                break
            cur[bad] = tree.nearest(tree.parent[cur[bad]], OP)
        out[q] = cur
    return out


class _SafeUnpickler(pickle.Unpickler):
    """Snapshots hold only dicts, lists, tuples, strings and numbers: refuse any class."""

    def find_class(self, module: str, name: str):
        raise AiprofError(f"memory snapshot refers to {module}.{name}: not a plain torch.cuda.memory._snapshot()")


# Inflate a gzipped snapshot this much at a time, so that a bomb is stopped at the trace limit
# (trace/limits.py: the same bound as a trace's JSON) instead of expanding whole in memory.
_INFLATE_CHUNK = 16 << 20


def _inflate_bounded(path: str, data: bytes) -> bytes:
    lim = limits.current()
    d = zlib.decompressobj(wbits=31)  # gzip framing
    out, total, rest = [], 0, data
    try:
        while rest and not d.eof:
            part = d.decompress(rest, _INFLATE_CHUNK)
            rest = d.unconsumed_tail
            total += len(part)
            if total > lim.max_bytes:
                raise AiprofError(f"{path}: decompresses to more than {lim.max_gb:g} GiB, the limit on one input "
                                  f"(--max-trace-gb or ${limits.ENV_MAX_TRACE_GB} raises it)")
            out.append(part)
    except zlib.error as exc:
        raise AiprofError(f"{path}: not a gzip file ({exc})") from None
    return b"".join(out)


def load_snapshot(path: str) -> dict:
    """Read a ``torch.cuda.memory._snapshot()`` pickle (optionally gzipped) without running code."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise AiprofError(f"{path}: {exc.strerror or exc}") from None
    if data[:2] == b"\x1f\x8b":
        data = _inflate_bounded(path, data)
    try:
        snap = _SafeUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise AiprofError(f"{path}: not a memory snapshot pickle ({exc})") from None
    if not isinstance(snap, dict) or "segments" not in snap:
        raise AiprofError(f"{path}: not a memory snapshot (no 'segments')")
    return snap


def _site(frames: list) -> str:
    """The first user frame of an allocation's stack ("file:line name")."""
    for fr in frames or []:
        fn = str(fr.get("filename", ""))
        if fn.endswith(".py") and not is_library_frame(_short_path(fn)):
            return f"{_short_path(fn)}:{fr.get('line', 0)} {fr.get('name', '')}"
    for fr in frames or []:
        fn = str(fr.get("filename", ""))
        if fn.endswith(".py"):
            return f"{_short_path(fn)}:{fr.get('line', 0)} {fr.get('name', '')}"
    return "(no Python frame)"


def _short_path(fn: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in fn:
            return fn.split(marker, 1)[1]
    return fn


def memory_from_snapshot(snap: dict, device: int = 0, top: int = 10) -> MemoryAnalysis:
    """Peak allocated memory over the snapshot's alloc/free trace, and the biggest allocation sites.

    Allocated bytes at the end are the active blocks of the segments; walking the trace
    backwards from there gives allocated bytes at every event, hence the peak inside the trace.
    """
    segs = [s for s in snap.get("segments", []) if s.get("device", 0) == device]
    final_alloc = sum(int(s.get("allocated_size", 0)) for s in segs)
    reserved = sum(int(s.get("total_size", 0)) for s in segs)
    traces = snap.get("device_traces") or []
    tr = traces[device] if device < len(traces) else []
    if not tr:
        return MemoryAnalysis("snapshot", final_alloc, reserved, None, None)
    act = [e.get("action") for e in tr]
    size = np.array([int(e.get("size", 0)) for e in tr], dtype=np.int64)
    sign = np.array([1 if a == "alloc" else -1 if a == "free_completed" else 0 for a in act], dtype=np.int64)
    delta = sign * size
    # allocated after event i = final - sum of deltas after i
    after = final_alloc - (delta.sum() - np.cumsum(delta))
    i = int(np.argmax(after))
    peak = max(int(after[i]), final_alloc)
    sites: dict[str, list[int]] = {}
    for e, a in zip(tr, act):
        if a == "alloc":
            s = sites.setdefault(_site(e.get("frames")), [0, 0])
            s[0] += 1
            s[1] += int(e.get("size", 0))
    tops = sorted(({"where": k, "calls": v[0], "bytes": v[1]} for k, v in sites.items()), key=lambda d: -d["bytes"])
    t_us = tr[i].get("time_us")
    return MemoryAnalysis("snapshot", peak, reserved, int(t_us * 1000) if t_us else None, None, tops[:top])
