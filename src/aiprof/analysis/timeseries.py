"""Small pure functions behind the UI's dashboard panels that no other analysis provides:
GPU busy share over time, hardware samples (``hw.csv`` beside a captured trace), GPU activity
and memory-operation distributions, annotation durations, histograms, and counters (memory,
hardware) downsampled to a pixel width.

Definitions are in docs/ui.md ("Definitions of the dashboard series"). Times are absolute ns on the trace
clock unless a name says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import gpu_busy
from aiprof.analysis.memo import analysis_cache
from aiprof.trace import classify
from aiprof.trace.hwcsv import hw_path_for
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
_CUDA_DEVICE_TYPE = 1


def histogram(values, bins: int = 20) -> dict:
    """Equal-width histogram: ``{"edges": [...bins+1], "counts": [...bins]}`` (empty input: no bins)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not len(v):
        return {"edges": [], "counts": []}
    bins = int(max(1, min(bins, 200)))
    lo, hi = float(v.min()), float(v.max())
    if hi <= lo:
        hi = lo + max(abs(lo) * 1e-6, 1e-9)
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    return {"edges": edges.tolist(), "counts": counts.astype(int).tolist()}


def gpu_busy_over_time(rt: RankTrace, lo: int, hi: int, bins: int = 200) -> dict:
    """Share (%) of each of ``bins`` equal intervals of ``[lo, hi)`` in which the GPU ran anything
    (kernels of any class, memcpy, memset): the trace-side "GPU utilisation" of SageMaker's
    dashboard, exact rather than sampled."""
    bins = int(max(1, min(bins, 4000)))
    hi = max(int(hi), int(lo) + bins)
    edges = np.linspace(int(lo), hi, bins + 1).astype(np.int64)
    u = gpu_busy(rt)
    cov = u.covered(edges[:-1], edges[1:]).astype(np.float64)
    width = np.diff(edges).astype(np.float64)
    return {"start_ns": int(lo), "bin_ns": float(width.mean()), "busy_pct": np.round(100.0 * cov / width, 2).tolist()}


@dataclass
class HwSamples:
    """Hardware samples of one rank in long form: ``series[(device, metric)] = (ts_ns, value)``."""

    path: str
    series: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]

    def metrics(self) -> list[dict]:
        return [{"device": d, "metric": m, "samples": int(len(v[0]))} for (d, m), v in sorted(self.series.items())]


def hw_path(rt: RankTrace) -> str | None:
    """``hw.csv`` written by the capture agent beside this rank's trace, if there is one."""
    return hw_path_for(rt.source)


def load_hw(rt: RankTrace) -> HwSamples | None:
    """The rank's hardware samples from the store's ``hw`` table, grouped per (device, metric);
    None when the capture has none."""
    cache = analysis_cache(rt)
    if "hw" in cache:
        return cache["hw"]
    h = rt.table("hw")
    out = None
    if len(h):
        dev, met = h.strings("device"), h.strings("metric")
        key = dev.codes.astype(np.int64) * (len(met.labels) + 1) + met.codes
        series = {}
        for k in npx.unique(key):
            sel = key == k  # rows are time-sorted in the store
            d, m = int(k) // (len(met.labels) + 1), int(k) % (len(met.labels) + 1)
            series[(dev.labels[d], met.labels[m])] = (h["ts"][sel], h["value"][sel])
        out = HwSamples(hw_path(rt) or "", series)
    cache["hw"] = out
    return out


#: A stretch between two samples of one series longer than this many of its median intervals
#: was not sampled (NVML is not read while PM samples: agent/hwmon.py): a chart shows a gap
#: there, not the last value held across it.
UNSAMPLED_GAP_INTERVALS = 3.0


def with_gaps(ts: np.ndarray, values: np.ndarray) -> tuple[list[int], list[float | None]]:
    """A sampled series as lists, with a ``None`` value (a gap: not sampled) after every sample
    followed by an unsampled stretch (UNSAMPLED_GAP_INTERVALS)."""
    t, v = [int(x) for x in ts.tolist()], [float(x) for x in values.tolist()]
    if len(t) < 3:
        return t, list(v)
    d = np.diff(np.asarray(ts, dtype=np.int64))
    limit = UNSAMPLED_GAP_INTERVALS * float(np.median(d))
    out_t: list[int] = []
    out_v: list[float | None] = []
    for i in range(len(t)):
        out_t.append(t[i])
        out_v.append(v[i])
        if i + 1 < len(t) and limit > 0 and d[i] > limit:
            out_t.append(t[i] + 1)  # just after the last sample before the stretch
            out_v.append(None)
    return out_t, out_v


HW_MEMORY = {"mem_used_bytes": "used", "proc_rss_bytes": "process RSS"}  # memory metrics of hw.csv


def hw_memory(hw: HwSamples | None, lo: int, hi: int, px: int) -> list[dict]:
    """Memory samples of ``hw.csv`` (NVML ``mem_used_bytes`` per GPU; the host's used memory and the
    process's RSS) over ``[lo, hi)``: per (device, metric) the series downsampled to ``px`` columns
    (maximum per column, so the peak stays) and the peak with its time. GPUs first."""
    if hw is None:
        return []
    out = []
    for (dev, metric), (ts, v) in sorted(hw.series.items(), key=lambda kv: (kv[0][0] == "host", kv[0])):
        if metric not in HW_MEMORY:
            continue
        a, b = np.searchsorted(ts, [lo, hi])
        if b <= a:
            continue
        i = a + int(np.argmax(v[a:b]))
        d = downsample(ts, v, lo, hi, px)
        out.append({"device": dev, "metric": metric, "label": f"{dev} {HW_MEMORY[metric]}", "ts": d["ts"],
                    "value": d["value"], "peak_bytes": float(v[i]), "peak_ts": int(ts[i]), "samples": int(b - a)})
    return out


HW_CPU_SYSTEM = "cpu_util_pct"  # all CPUs busy since the previous sample (psutil), %
HW_CPU_PROCESS = "proc_cpu_pct"  # this process's CPU time since the previous sample, % of one CPU


def interval_mean(ts: np.ndarray, values: np.ndarray, lo: int, hi: int) -> tuple[float | None, int]:
    """Time-weighted mean over ``[lo, hi)`` of a rate sampled as "average since the previous
    sample" (sample ``i`` covers ``(ts[i-1], ts[i]]``; the first sample covers nothing known and
    is skipped). Returns ``(mean, covered_ns)``; mean is None when no interval overlaps."""
    ts, values = np.asarray(ts, np.int64), np.asarray(values, np.float64)
    if len(ts) < 2 or hi <= lo:
        return None, 0
    a, b = np.maximum(ts[:-1], lo), np.minimum(ts[1:], hi)
    w = np.maximum(b - a, 0).astype(np.float64)
    covered = float(w.sum())
    if covered <= 0:
        return None, 0
    return float((w * values[1:]).sum() / covered), int(covered)


def cpu_active_idle(hw: HwSamples | None, lo: int, hi: int) -> dict | None:
    """CPU active vs idle over the capture window ``[lo, hi)``: the time-weighted means of the
    host's system CPU utilisation (``cpu_util_pct``: all CPUs, %) and of the process's CPU use
    (``proc_cpu_pct``: % of one CPU, can exceed 100), from the agent's host samples. None when
    the capture has no host CPU samples covering the window."""
    if hw is None:
        return None
    sysm = [(d, v) for (d, m), v in sorted(hw.series.items()) if m == HW_CPU_SYSTEM]
    if not sysm:
        return None
    dev, (ts, v) = sysm[0]
    active, covered = interval_mean(ts, v, lo, hi)
    if active is None:
        return None
    active = min(max(active, 0.0), 100.0)
    proc = hw.series.get((dev, HW_CPU_PROCESS))
    proc_mean = interval_mean(proc[0], proc[1], lo, hi)[0] if proc is not None else None
    return {"device": dev, "window_ns": [int(lo), int(hi)], "covered_ns": covered, "samples": len(ts),
            "active_pct": active, "idle_pct": 100.0 - active, "process_cpu_pct": proc_mean}


def downsample(ts: np.ndarray, values: np.ndarray, t0: int, t1: int, px: int, how: str = "max") -> dict:
    """A counter over ``[t0, t1)`` reduced to at most ``px`` points (max, or mean, per column),
    plus the last value before ``t0`` and the first at or after ``t1`` so a step line reaches
    both edges (a gauge holds ``before``; a rate sampled since the previous sample, ``after``)."""
    px = int(max(1, min(px, 8192)))
    ts, values = np.asarray(ts, np.int64), np.asarray(values, np.float64)
    a, b = np.searchsorted(ts, [t0, t1])
    before = float(values[a - 1]) if a > 0 else None
    after = float(values[b]) if b < len(values) else None
    t, v = ts[a:b], values[a:b]
    if len(t) > px:
        col = ((t - t0) * px // max(t1 - t0, 1)).astype(np.int64)
        starts = np.concatenate([[0], np.nonzero(np.diff(col))[0] + 1])
        if how == "mean":
            vv = np.add.reduceat(v, starts) / np.diff(np.concatenate([starts, [len(v)]]))
        else:
            vv = np.maximum.reduceat(v, starts)
        t, v = t[starts], vv
    return {"ts": t.tolist(), "value": v.tolist(), "before": before, "after": after}


def gpu_activity(rt: RankTrace) -> dict:
    """GPU time and counts by activity: kernels, memcpy, memset. (Kineto's ``cuda_sync`` events
    are not GPU work: they are the host's waits in synchronisation calls, drawn on the stream; the
    report's ``sync_us`` is the host-side figure.)"""
    out = {}
    k = rt.kernels
    out["kernels"] = {"count": int(len(k)), "time_us": float(k["dur"].sum()) / NS_PER_US if len(k) else 0.0}
    m = rt.memops
    for kind in ("memcpy", "memset"):
        sel = (m.strings("kind").isin_labels(lambda s, kk=kind: s == kk)) if len(m) else np.zeros(0, bool)
        out[kind] = {"count": int(sel.sum()), "time_us": float(m["dur"][sel].sum()) / NS_PER_US if len(m) else 0.0}
    return out


def memop_distribution(rt: RankTrace) -> list[dict]:
    """Per memory operation type (e.g. ``Memcpy HtoD (Pageable -> Device)``): count, bytes, time."""
    m = rt.memops
    if not len(m):
        return []
    names = m.strings("name")
    n = len(names.labels)
    cnt = np.bincount(names.codes, minlength=n)
    byt = np.bincount(names.codes, weights=np.maximum(m["bytes"], 0), minlength=n)
    dur = np.bincount(names.codes, weights=m["dur"], minlength=n)
    out = [{"name": names.labels[c], "kind": classify.copy_kind(names.labels[c])[0]
            or ("memset" if names.labels[c].startswith("Memset") else ""), "count": int(cnt[c]),
            "bytes": int(byt[c]), "time_us": float(dur[c]) / NS_PER_US} for c in np.argsort(-dur) if cnt[c]]
    return out


def annotation_names(rt: RankTrace) -> list[dict]:
    """Host ``record_function`` annotations (not ProfilerStep#N): name, calls, total time."""
    a = rt.annotations
    if not len(a):
        return []
    sel = ~a["gpu"] & ~a.strings("name").isin_labels(lambda s: s.startswith("ProfilerStep#"))
    names = a.strings("name")
    n = len(names.labels)
    cnt = np.bincount(names.codes[sel], minlength=n)
    tot = np.bincount(names.codes[sel], weights=a["dur"][sel], minlength=n)
    return [{"name": names.labels[c], "calls": int(cnt[c]), "total_us": float(tot[c]) / NS_PER_US}
            for c in np.argsort(-tot) if cnt[c]]


def annotation_durations_us(rt: RankTrace, name: str) -> np.ndarray:
    """Durations (µs) of every host annotation called ``name``."""
    a = rt.annotations
    if not len(a):
        return np.zeros(0)
    sel = ~a["gpu"] & a.strings("name").isin_labels(lambda s: s == name)
    return a["dur"][sel] / NS_PER_US


def memory_counters(rt: RankTrace) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """CUDA ``allocated`` and ``reserved`` bytes over time from the ``memory`` table (device of
    the rank), sorted by time; empty when the trace has no memory events."""
    m = rt.memory
    if not len(m) or "total_allocated" not in m:
        return {}
    sel = m["device_type"] == _CUDA_DEVICE_TYPE
    dev = rt.meta.get("device")
    if dev is not None:
        sel &= m["device_id"] == dev
    out = {}
    for col, label in (("total_allocated", "allocated"), ("total_reserved", "reserved")):
        ok = sel & (m[col] >= 0)
        if ok.any():
            o = np.argsort(m["ts"][ok], kind="stable")
            out[label] = (m["ts"][ok][o].astype(np.int64), m[col][ok][o].astype(np.float64))
    return out
