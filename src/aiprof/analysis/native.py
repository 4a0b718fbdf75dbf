"""Native data of a rank: library calls (probe files), NCCL calls joined to their kernels and
to the Python/op that issued them, and the system calls threads were blocked in.

Definitions (docs/metrics.md, "Native"):

* **host enqueue time** of a collective: the duration of its ``nccl*`` call on the host (the
  call returns once the work is queued on the stream); **GPU time**: its kernel's duration.
* A call is **joined** to a kernel when the kernel's launch (the CUDA call with the kernel's
  correlation id) runs inside the call, on the same thread, or inside the ``ncclGroupEnd`` that
  closes the call's group; failing a launch record, the k-th call of a kind on a stream is
  paired with the k-th kernel of that collective kind (``join`` says which).
* **blocked time** of a thread in a system call: samples × the sampling interval
  (aiprof.native.syscalls); **while the GPU idles**: the part of it outside every GPU interval.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from aiprof.analysis.launch import launch_rows
from aiprof.records import as_dict
from aiprof.trace.store import RankTrace

NCCL_COLLECTIVES = {"ncclAllReduce": "allreduce", "ncclBroadcast": "broadcast", "ncclReduce": "reduce",
                    "ncclAllGather": "allgather", "ncclReduceScatter": "reduce_scatter", "ncclSend": "send",
                    "ncclRecv": "recv", "ncclAllToAll": "alltoall"}
# Kineto's dtype names -> bytes per element (the GPU collective's message size)
_DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
                "int": 4, "int32": 4, "long": 8, "int64": 8, "byte": 1, "char": 1, "int8": 1, "uint8": 1,
                "bool": 1, "short": 2, "int16": 2}
TOP_CALLS = 200  # collectives listed one by one in the report (the summary covers all)
# torch records a collective (record_param_comms) right before it calls NCCL on the same thread;
# a record further back than this belongs to an earlier collective
# The probe's call times reach the trace clock through the sidecar's clock mapping, which can be
# tens of µs off Kineto's: the kernel launches inside ncclAllReduce were recorded 2-25 µs into
# the call on one rank and 61-89 µs after the call's start (past its end) on the other (2-rank
# DDP on two H200s). A call takes the nearest unused launch within this of its window.
JOIN_CLOCK_TOL_NS = 100_000
ISSUE_WINDOW_NS = 2_000_000


@dataclass
class SymbolStats:
    """One traced symbol: calls, host time, the most common thread."""

    lib: str
    name: str
    calls: int
    total_us: float
    mean_us: float
    max_us: float
    bytes: int  # sum of the ``bytes`` argument where the probe gives one (NCCL: count × dtype)


@dataclass
class Collective:
    """One NCCL call joined to its kernel and its issuer."""

    ts_us: float
    symbol: str
    coll: str
    count: int
    bytes: int
    datatype: str
    comm: str
    stream: str
    host_us: float  # the nccl* call's duration (enqueue)
    gpu_us: float | None  # the kernel's duration
    kernel: str
    kernel_bytes: int | None  # the kernel's message size from the trace (in_nelems × dtype)
    op_bytes: int | None  # the message size torch recorded for the op that issued it (record_param_comms)
    group: bool  # issued inside ncclGroupStart/End
    join: str  # launch | group | order | none
    issuer: str  # the innermost torch op / Python frame around the call on its thread


@dataclass
class SyscallStats:
    """One system call (or class) over a rank's analysed window."""

    name: str
    cls: str
    episodes: int
    blocked_us: float
    while_gpu_idle_us: float
    threads: int
    top_path: str = ""


@dataclass
class NativeAnalysis:
    """What the native sidecar recorded on one rank (empty lists when it recorded nothing)."""

    symbols: list[SymbolStats] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    collectives_total: int = 0
    collectives_by_comm: list[dict] = field(default_factory=list)
    sizes_match: dict = field(default_factory=dict)  # joined calls whose bytes equal the kernel's
    syscalls: list[SyscallStats] = field(default_factory=list)
    syscall_threads: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _args(row: str) -> dict:
    try:
        a = json.loads(row)
        return a if isinstance(a, dict) else {}
    except ValueError:
        return {}


def _issuer(rt: RankTrace, tid: int, ts: int) -> str:
    """The innermost torch op (else Python frame) open on ``tid`` at ``ts`` (torch's own
    ``record_param_comms`` bookkeeping op skipped)."""
    for name in ("ops", "python"):
        t = rt.table(name)
        if not len(t) or "tid" not in t:
            continue
        m = (t["tid"] == tid) & (t["ts"] <= ts) & (t["ts"] + t["dur"] >= ts)
        if name == "ops":
            m &= t.strings("name").values() != "record_param_comms"
        idx = np.nonzero(m)[0]
        if len(idx):
            best = idx[np.argmax(t["ts"][idx])]  # the latest start: the innermost
            return str(t.strings("name").values()[best])
    return ""


def native_analysis(rt: RankTrace, lo: int | None = None, hi: int | None = None) -> NativeAnalysis:
    """Summaries of the rank's ``calls`` and ``syscalls`` tables within [lo, hi] ns (all if None)."""
    out = NativeAnalysis()
    native_meta = ((rt.meta.get("capture") or {}).get("native") or {})
    out.notes = list(native_meta.get("notes") or [])
    calls = rt.table("calls")
    if len(calls):
        if lo is not None and hi is not None:
            calls = calls.take((calls["ts"] >= lo) & (calls["ts"] <= hi))
        _symbols(calls, out)
        _collectives(rt, calls, out)
    sc = rt.table("syscalls")
    if len(sc):
        if lo is not None and hi is not None:
            sc = sc.take((sc["ts"] + sc["dur"] >= lo) & (sc["ts"] <= hi))
        _syscalls(rt, sc, out, lo, hi)
    return out


def _symbols(calls, out: NativeAnalysis) -> None:
    lib, name = calls.strings("lib").values(), calls.strings("name").values()
    keys = np.array([f"{a}\0{b}" for a, b in zip(lib, name)])
    for k in np.unique(keys):
        m = keys == k
        d = calls["dur"][m] / 1e3
        b = calls["bytes"][m]
        a, n = str(k).split("\0")
        out.symbols.append(SymbolStats(a, n, int(m.sum()), float(d.sum()), float(d.mean()), float(d.max()),
                                       int(b[b > 0].sum())))
    out.symbols.sort(key=lambda s: -s.total_us)


def _collectives(rt: RankTrace, calls, out: NativeAnalysis) -> None:
    names = calls.strings("name").values()
    is_coll = np.array([n in NCCL_COLLECTIVES for n in names], dtype=bool)
    if not is_coll.any():
        return
    tid, ts, dur = calls["tid"], calls["ts"], calls["dur"]
    # group membership: a call between ncclGroupStart and ncclGroupEnd on its thread
    group_end = np.full(len(calls), -1, dtype=np.int64)
    open_at: dict[int, int] = {}
    depth: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for i in range(len(calls)):
        t = int(tid[i])
        if names[i] == "ncclGroupStart":
            depth[t] = depth.get(t, 0) + 1
            open_at.setdefault(t, i)
            members.setdefault(t, [])
        elif names[i] == "ncclGroupEnd" and depth.get(t, 0) > 0:
            depth[t] -= 1
            if depth[t] == 0:
                for j in members.pop(t, []):
                    group_end[j] = i
                open_at.pop(t, None)
        elif is_coll[i] and depth.get(t, 0) > 0:
            members[t].append(i)
    # the GPU side: collective kernels, their launches and sizes
    k = rt.table("kernels")
    gcoll = rt.table("collectives")
    gpu = gcoll.take(gcoll.strings("side").values() == "gpu") if len(gcoll) else gcoll
    kern_of_corr: dict[int, int] = {}
    if len(k):
        for i, c in enumerate(k["corr"].tolist()):
            kern_of_corr.setdefault(int(c), i)
    launch_ts = np.zeros(0, np.int64)
    launch_tid = np.zeros(0, np.int64)
    kern_rows = np.zeros(0, np.int64)
    if len(k):
        is_nccl = np.array(["nccl" in s.lower() for s in k.strings("name").values()], dtype=bool)
        kern_rows = np.nonzero(is_nccl)[0]
        rt_rows = launch_rows(rt.runtime, k.take(kern_rows)) if len(kern_rows) else np.zeros(0, np.int64)
        have = rt_rows >= 0
        launch_ts = np.where(have, rt.runtime["ts"][np.maximum(rt_rows, 0)] if len(rt.runtime) else 0, -1)
        launch_tid = np.where(have, rt.runtime["tid"][np.maximum(rt_rows, 0)] if len(rt.runtime) else 0, -1)
    size_of_corr: dict[int, int] = {}
    if len(gpu):
        dts = gpu.strings("dtype").values()
        for c, n, dt in zip(gpu["corr"].tolist(), gpu["in_nelems"].tolist(), dts):
            eb = _DTYPE_BYTES.get(str(dt).lower())
            if n is not None and n >= 0 and eb:
                size_of_corr[int(c)] = int(n) * eb
    used = np.zeros(len(kern_rows), dtype=bool)
    rows = np.nonzero(is_coll)[0]
    knames = k.strings("name").values() if len(k) else []
    joined: list[Collective] = []
    for i in rows:
        a = _args(calls.strings("args").values()[i])
        g = int(group_end[i])
        win_lo, win_hi = int(ts[i]) - JOIN_CLOCK_TOL_NS, int(ts[i] + dur[i]) + JOIN_CLOCK_TOL_NS
        how = "none"
        hit = np.zeros(0, np.int64)
        if len(kern_rows):
            inside = (~used) & (launch_tid == tid[i]) & (launch_ts >= win_lo) & (launch_ts <= win_hi)
            hit = np.nonzero(inside)[0]
            how = "launch" if len(hit) else how
            if not len(hit) and g >= 0:
                gl, gh = int(ts[g]) - JOIN_CLOCK_TOL_NS, int(ts[g] + dur[g]) + JOIN_CLOCK_TOL_NS
                inside = (~used) & (launch_tid == tid[i]) & (launch_ts >= gl) & (launch_ts <= gh)
                hit = np.nonzero(inside)[0]
                how = "group" if len(hit) else how
        kname, gpu_us, kbytes = "", None, None
        if len(hit):
            j = int(hit[np.argmin(np.abs(launch_ts[hit] - int(ts[i])))])
            used[j] = True
            kr = int(kern_rows[j])
            kname, gpu_us = str(knames[kr]), float(k["dur"][kr]) / 1e3
            kbytes = size_of_corr.get(int(k["corr"][kr]))
        op_bytes = None
        if len(gcoll):  # torch's record of the collective (record_param_comms) just before the call
            cpu = (gcoll.strings("side").values() == "cpu") & (gcoll["tid"] == tid[i]) & (gcoll["ts"] <= ts[i]) \
                & (gcoll["ts"] >= ts[i] - ISSUE_WINDOW_NS)
            ci = np.nonzero(cpu)[0]
            if len(ci):
                c0 = ci[np.argmax(gcoll["ts"][ci])]
                eb = _DTYPE_BYTES.get(str(gcoll.strings("dtype").values()[c0]).lower())
                n0 = int(gcoll["in_nelems"][c0])
                op_bytes = n0 * eb if eb and n0 >= 0 else None
        joined.append(Collective(
            ts_us=float(ts[i]) / 1e3, symbol=str(names[i]), coll=NCCL_COLLECTIVES[str(names[i])],
            count=int(a.get("count", -1)) if isinstance(a.get("count"), int) else -1,
            bytes=int(a.get("bytes", -1)) if isinstance(a.get("bytes"), int) else -1,
            datatype=str(a.get("datatype", "")), comm=str(a.get("comm", "")), stream=str(a.get("stream", "")),
            host_us=float(dur[i]) / 1e3, gpu_us=gpu_us, kernel=kname, kernel_bytes=kbytes, op_bytes=op_bytes,
            group=g >= 0,
            join=how, issuer=_issuer(rt, int(tid[i]), int(ts[i]))))
    # no launch records (a trace without CUDA runtime events): pair in order, per collective kind
    if len(kern_rows) and not any(c.join in ("launch", "group") for c in joined):
        kinds: dict[str, list[int]] = {}
        for j, kr in enumerate(kern_rows.tolist()):
            low = str(knames[kr]).lower().replace("_", "")
            for coll in set(NCCL_COLLECTIVES.values()):
                if coll.replace("_", "") in low:
                    kinds.setdefault(coll, []).append(kr)
        taken: dict[str, int] = {}
        for c in joined:
            lst = kinds.get(c.coll, [])
            n = taken.get(c.coll, 0)
            if n < len(lst):
                kr = lst[n]
                taken[c.coll] = n + 1
                c.kernel, c.gpu_us, c.join = str(knames[kr]), float(k["dur"][kr]) / 1e3, "order"
                c.kernel_bytes = size_of_corr.get(int(k["corr"][kr]))
    out.collectives_total = len(joined)
    out.collectives = joined[:TOP_CALLS]
    comp = [c for c in joined if c.kernel_bytes is not None and c.bytes >= 0]
    opc = [c for c in joined if c.op_bytes is not None and c.bytes >= 0]
    out.sizes_match = {"compared": len(comp), "equal": sum(1 for c in comp if c.kernel_bytes == c.bytes),
                       "op_compared": len(opc), "op_equal": sum(1 for c in opc if c.op_bytes == c.bytes),
                       "joined": sum(1 for c in joined if c.join != "none"), "calls": len(joined)}
    by: dict[tuple[str, str], dict] = {}
    for c in joined:
        e = by.setdefault((c.comm, c.coll), {"comm": c.comm, "coll": c.coll, "calls": 0, "bytes": 0,
                                             "host_us": 0.0, "gpu_us": 0.0, "grouped": 0})
        e["calls"] += 1
        e["bytes"] += max(c.bytes, 0)
        e["host_us"] += c.host_us
        e["gpu_us"] += c.gpu_us or 0.0
        e["grouped"] += int(c.group)
    out.collectives_by_comm = sorted(by.values(), key=lambda e: -e["gpu_us"] - e["host_us"])


def _syscalls(rt: RankTrace, sc, out: NativeAnalysis, lo: int | None, hi: int | None) -> None:
    from aiprof.analysis.hotspots import gpu_busy, has_gpu

    busy = gpu_busy(rt) if has_gpu(rt) else None
    st, en = sc["ts"], sc["ts"] + sc["dur"]
    if lo is not None and hi is not None:  # a wait that began before the window counts from its start
        st, en = np.clip(st, lo, hi), np.clip(en, lo, hi)
    dur = en - st
    if busy is not None and len(busy.start):
        idle = (en - st) - busy.covered(st, en)
    else:
        idle = (en - st).astype(np.int64)
    names, cls, paths, thr = (sc.strings("name").values(), sc.strings("cls").values(), sc.strings("path").values(),
                              sc.strings("thread").values())
    for n in np.unique(names):
        m = names == n
        p = paths[m]
        d = dur[m]
        top = ""
        if any(p):
            by_path: dict[str, int] = {}
            for pp, dd in zip(p.tolist(), d.tolist()):
                if pp:
                    by_path[pp] = by_path.get(pp, 0) + int(dd)
            top = max(by_path, key=by_path.get) if by_path else ""
        out.syscalls.append(SyscallStats(str(n), str(cls[m][0]), int(m.sum()), float(d.sum()) / 1e3,
                                         float(idle[m].sum()) / 1e3, int(len(np.unique(sc["tid"][m]))), top))
    out.syscalls.sort(key=lambda s: -s.blocked_us)
    for t in np.unique(sc["tid"]):
        m = sc["tid"] == t
        per: dict[str, float] = {}
        for n, d in zip(names[m].tolist(), dur[m].tolist()):
            per[n] = per.get(n, 0.0) + d / 1e3
        out.syscall_threads.append({"tid": int(t), "thread": str(thr[m][0]), "blocked_us": float(dur[m].sum()) / 1e3,
                                    "by_syscall_us": dict(sorted(per.items(), key=lambda kv: -kv[1])[:6])})
    out.syscall_threads.sort(key=lambda e: -e["blocked_us"])


def native_dict(rt: RankTrace, lo: int | None = None, hi: int | None = None) -> dict | None:
    """JSON-ready :class:`NativeAnalysis`, or None when the rank has no native data."""
    if not len(rt.table("calls")) and not len(rt.table("syscalls")) and not (rt.meta.get("capture") or {}).get("native"):
        return None
    return as_dict(native_analysis(rt, lo, hi))
