"""GPU performance-monitor counters (CUPTI PM samples, the store's ``pm`` table) read against
the trace: per kernel family, per collective, and as a whole.

PM counters are device-wide and each sample covers a window (~100 µs). The value "during" a
set of kernels is the mean of the samples weighted by how much of each sample's window those
kernels cover: a family whose kernels fill the windows it appears in reads its own behaviour,
one of short kernels between others reads a blend, which ``coverage_pct`` shows. Definitions in
docs/metrics.md ("GPU counters").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof.analysis.memo import analysis_cache
from aiprof.hardware import device as device_spec
from aiprof.trace.pmclock import alignment_check
from aiprof.trace.store import RankTrace
from aiprof.trace.table import Table

NS_PER_US = 1000.0

#: A family is memory-bound when DRAM traffic during it is at least this share of peak: beyond
#: ~60% the memory system, not the SMs, sets the pace (roofline ridge, achieved-bandwidth
#: ceilings on Hopper are ~90% of the datasheet figure).
MEMORY_BOUND_DRAM_PCT = 60.0
#: ...and compute-bound when the tensor pipes are active at least this share of the time, or
#: the SMs issue instructions at least ``COMPUTE_BOUND_ISSUE_PCT`` of their peak.
COMPUTE_BOUND_TENSOR_PCT = 50.0
COMPUTE_BOUND_ISSUE_PCT = 60.0
#: SMs active below this share while kernels run: most of the SM array idles (an undersized
#: grid or a serial tail), whatever else the kernel does.
IDLE_SM_PCT = 50.0
#: The alignment check's residual lag is removed before counters are read per kernel when the
#: check is this sure (Pearson r of SM activity against "a kernel runs"; the H100 phases test
#: gave 0.996) and the lag is at most ``MAX_SHIFT_US`` (a few samples: larger is a clock problem
#: to report, not to paper over).
SHIFT_MIN_CORRELATION = 0.8
MAX_SHIFT_US = 1000.0
#: Signals the alignment check reads, as (PM column, the kernels whose running makes the
#: reference): SM activity against any compute kernel has the sharpest edges where the GPU idles
#: between kernels, but on a saturated GPU (kernels back to back) both read flat ("correlation
#: 0.05 < 0.3" on an H200 GPT-2 job); tensor-pipe activity against matmul kernels still switches
#: at every GEMM's boundary. On the two real captures in tests/data both give the same lag.
ALIGNMENT_SIGNALS = (("pm_sm_active_pct", "compute kernels"), ("pm_tensor_active_pct", "matmul kernels"))
#: A family needs this much sampled time before its counters are read (two sample periods).
MIN_FAMILY_OVERLAP_US = 200.0


@dataclass
class PmSeries:
    """One device's PM samples: windows [t0, t1) in trace ns, and a value array per column."""

    device: str
    t0: np.ndarray
    t1: np.ndarray
    values: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.t0)


def load_pm(rt: RankTrace) -> PmSeries | None:
    """The rank's PM samples (the first device's, which is the one the rank drives), or None."""
    cache = analysis_cache(rt)
    if "pm" in cache:
        return cache["pm"]
    t = rt.table("pm")
    out = None
    if len(t):
        dev = t.strings("device")
        first = dev.codes == dev.codes[0]
        met = t.strings("metric")
        t0_all, t1_all, v_all, m_all = t["t0"][first], t["t1"][first], t["value"][first], met.codes[first]
        values: dict[str, np.ndarray] = {}
        t0 = t1 = None
        for code in np.unique(m_all):
            sel = m_all == code
            a = t0_all[sel]
            order = np.argsort(a, kind="stable")
            if t0 is None:
                t0, t1 = a[order], t1_all[sel][order]
            if len(order) == len(t0):
                values[met.labels[code]] = v_all[sel][order]
        if t0 is not None and len(t0):
            out = PmSeries(dev.labels[dev.codes[0]], t0.astype(np.int64), t1.astype(np.int64), values)
    cache["pm"] = out
    return out


def _weights(pm: PmSeries, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """ns of each sample window covered by the given intervals (overlaps between them counted once
    per interval: callers pass disjoint kernels of one stream family)."""
    w = np.zeros(len(pm), dtype=np.float64)
    if not len(starts):
        return w
    i0 = np.searchsorted(pm.t1, starts, side="right")
    i1 = np.searchsorted(pm.t0, ends, side="left")
    span = i1 - i0
    if not len(span) or span.max() <= 0:
        return w
    # expand (interval, sample) pairs; kernels are short against a sample, so pairs stay ~2x n
    reps = np.maximum(span, 0)
    k = np.repeat(np.arange(len(starts)), reps)
    first = np.repeat(i0, reps)
    offs = np.arange(len(k)) - np.repeat(np.cumsum(reps) - reps, reps)
    s = first + offs
    ov = np.minimum(pm.t1[s], ends[k]) - np.maximum(pm.t0[s], starts[k])
    np.add.at(w, s, np.maximum(ov, 0).astype(np.float64))
    return w


def weighted_means(pm: PmSeries, w: np.ndarray) -> dict[str, float]:
    """Every column's mean weighted by ``w`` (empty when nothing overlaps)."""
    tot = float(w.sum())
    if tot <= 0:
        return {}
    return {c: float((v * w).sum() / tot) for c, v in pm.values.items()}


def dram_pct(means: dict[str, float], peak_bps: float | None) -> float | None:
    """DRAM read+write traffic as % of peak: from the _pct counters, else bytes/s over the peak."""
    if "pm_dram_read_pct" in means or "pm_dram_write_pct" in means:
        return means.get("pm_dram_read_pct", 0.0) + means.get("pm_dram_write_pct", 0.0)
    if peak_bps and ("pm_dram_read_Bps" in means or "pm_dram_write_Bps" in means):
        return 100.0 * (means.get("pm_dram_read_Bps", 0.0) + means.get("pm_dram_write_Bps", 0.0)) / peak_bps
    return None


def bound_of(means: dict[str, float], dram: float | None) -> str:
    """memory | compute | idle-sms | mixed | unknown, from the thresholds above."""
    if not means:
        return "unknown"
    tensor = means.get("pm_tensor_active_pct")
    issue = means.get("pm_sm_issue_pct")
    sm = means.get("pm_sm_active_pct")
    if (tensor is not None and tensor >= COMPUTE_BOUND_TENSOR_PCT) or (issue is not None and issue >= COMPUTE_BOUND_ISSUE_PCT):
        return "compute"
    if dram is not None and dram >= MEMORY_BOUND_DRAM_PCT:
        return "memory"
    if sm is not None and sm < IDLE_SM_PCT:
        return "idle-sms"
    return "mixed" if (tensor is not None or dram is not None) else "unknown"


@dataclass
class CounterAnalysis:
    """What the PM counters say about one rank (docs/metrics.md, "GPU counters")."""

    device: str
    columns: list[str]
    samples: int
    interval_us: dict  # achieved gap between sample starts: median, p99, max
    alignment: dict  # residual lag against the kernels (trace.pmclock.alignment_check), and the shift applied
    dram_peak_gbps: float | None
    nvlink_peak_gbps: float | None  # per direction
    overall: dict  # means over the whole sampled span
    during_kernels: dict  # means weighted by compute-kernel coverage
    outside_kernels: dict  # means over the sampled time with no kernel running
    matmul: dict  # means weighted by matmul/attention kernel coverage (analysis.kernels.is_matmul_kernel)
    not_matmul: dict  # means over the sampled time not covered by matmul kernels
    families: list[dict] = field(default_factory=list)  # per kernel family: counters, bound
    collectives: list[dict] = field(default_factory=list)  # per communication kernel name: NVLink vs peak


def recorded_part(pm: PmSeries, kernels: Table) -> PmSeries:
    """The samples whose window meets the recorded kernels' span. The sampler starts before the
    recording (its set-up first, agent/capture.py) and stops after it: samples outside have no
    kernel to be read against, and would make the whole read as idle GPU (and leave the alignment
    check no edge: a second of samples before the first kernel, 4 H200s, 2026-11-26)."""
    if not len(kernels):
        return pm
    ts = kernels["ts"].astype(np.int64)
    lo, hi = int(ts.min()), int((ts + kernels["dur"].astype(np.int64)).max())
    keep = (pm.t1 > lo) & (pm.t0 < hi)
    if keep.all():
        return pm
    return PmSeries(pm.device, pm.t0[keep], pm.t1[keep], {c: v[keep] for c, v in pm.values.items()})


def best_alignment(pm: PmSeries, kernel_sets: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    """The alignment check (trace.pmclock) on every signal of ``ALIGNMENT_SIGNALS`` the capture
    has; the one that tells, with the highest correlation, or the first one's reason why none
    could. ``kernel_sets``: name -> (starts, ends) in trace ns. {} when no signal applies."""
    tried: list[dict] = []
    for column, kernels in ALIGNMENT_SIGNALS:
        v = pm.values.get(column)
        st, en = kernel_sets.get(kernels, (np.zeros(0), np.zeros(0)))
        if v is None or not len(st):
            continue
        chk = alignment_check(pm.t0 / NS_PER_US, pm.t1 / NS_PER_US, v, st / NS_PER_US, en / NS_PER_US)
        tried.append({"lag_us": chk.lag_us, "correlation": chk.correlation, "why": chk.why,
                      "signal": f"{column} vs {kernels}"})
    told = [t for t in tried if t["lag_us"] is not None]
    if told:
        return max(told, key=lambda t: t["correlation"])
    return tried[0] if tried else {}


def _union_weights(pm: PmSeries, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    from aiprof.analysis.intervals import union

    u = union(starts, ends)
    return u.covered(pm.t0, pm.t1).astype(np.float64)


def counter_analysis(rt: RankTrace, families: list[str] | None = None) -> CounterAnalysis | None:
    """Counters per family of compute kernels (``families``: the names to report, by
    analysis.kernels.kernel_family; None = all), per collective, and overall."""
    pm = load_pm(rt)
    if pm is None or len(pm) < 2:
        return None
    from aiprof.analysis.kernels import kernel_family

    dev = device_spec(rt.device_name)
    dram_peak = dev.dram_gbps * 1e9 if dev else None
    link_peak = dev.nvlink_gbps_per_dir if dev else None
    k = rt.kernels
    pm = recorded_part(pm, k)
    if len(pm) < 2:
        return None
    gaps = np.diff(pm.t0) / NS_PER_US
    interval = {"median": float(np.median(gaps)), "p99": float(np.percentile(gaps, 99)), "max": float(gaps.max())}
    span = (pm.t1 - pm.t0).astype(np.float64)
    overall = weighted_means(pm, span)
    names = k.strings("name") if len(k) else None
    comm = k.strings("cls").isin_labels(lambda s: s == "communication") if len(k) else np.zeros(0, bool)
    start = k["ts"].astype(np.int64) if len(k) else np.zeros(0, np.int64)
    end = start + (k["dur"].astype(np.int64) if len(k) else 0)
    comp = ~comm
    from aiprof.analysis.kernels import is_matmul_kernel

    if names is not None and comp.any():
        mm_label = np.array([is_matmul_kernel(x) for x in names.labels] + [False], dtype=bool)
        mm = comp & mm_label[names.codes]
    else:
        mm = np.zeros(len(start), dtype=bool)
    align = best_alignment(pm, {"compute kernels": (start[comp], end[comp]), "matmul kernels": (start[mm], end[mm])})
    if align:
        align["applied_shift_us"] = 0.0
        lag = align["lag_us"]
        if lag and (align["correlation"] or 0) >= SHIFT_MIN_CORRELATION and abs(lag) <= MAX_SHIFT_US:
            sh = int(round(lag * NS_PER_US))
            pm = PmSeries(pm.device, pm.t0 - sh, pm.t1 - sh, pm.values)
            align["applied_shift_us"] = -lag
    busy_w = _union_weights(pm, start[comp], end[comp]) if comp.any() else np.zeros(len(pm))
    during = weighted_means(pm, busy_w)
    outside = weighted_means(pm, np.maximum(span - busy_w, 0.0))
    mm_w = _union_weights(pm, start[mm], end[mm]) if mm.any() else np.zeros(len(pm))
    matmul = weighted_means(pm, mm_w)
    not_matmul = weighted_means(pm, np.maximum(span - mm_w, 0.0))
    fams: list[dict] = []
    if names is not None and comp.any():
        fam_of_label = [kernel_family(s) for s in names.labels]
        fam_index: dict[str, int] = {}
        fam_codes = np.array([fam_index.setdefault(f, len(fam_index)) for f in fam_of_label] + [-1], dtype=np.int64)
        wanted = set(families) if families is not None else set(fam_index)
        for fam, fc in fam_index.items():
            if fam not in wanted:
                continue
            sel = comp & (fam_codes[names.codes] == fc)
            if not sel.any():
                continue
            w = _weights(pm, start[sel], end[sel])
            ov_us = float(w.sum()) / NS_PER_US
            if ov_us < MIN_FAMILY_OVERLAP_US:
                continue
            m = weighted_means(pm, w)
            touched = w > 0
            cov = 100.0 * float(w[touched].sum() / span[touched].sum()) if touched.any() else 0.0
            d = dram_pct(m, dram_peak)
            fams.append({"family": fam, "kernels": int(sel.sum()), "sampled_us": ov_us, "coverage_pct": cov,
                         "counters": m, "dram_pct_of_peak": d, "bound": bound_of(m, d)})
        fams.sort(key=lambda x: -x["sampled_us"])
    colls: list[dict] = []
    if names is not None and comm.any():
        for code in np.unique(names.codes[comm]):
            sel = comm & (names.codes == code)
            w = _weights(pm, start[sel], end[sel])
            if float(w.sum()) / NS_PER_US < MIN_FAMILY_OVERLAP_US:
                continue
            m = weighted_means(pm, w)
            tx, rx = m.get("pm_nvlink_tx_Bps"), m.get("pm_nvlink_rx_Bps")
            colls.append({"name": names.labels[code], "calls": int(sel.sum()), "sampled_us": float(w.sum()) / NS_PER_US,
                          "nvlink_tx_gbps": tx / 1e9 if tx is not None else None,
                          "nvlink_rx_gbps": rx / 1e9 if rx is not None else None,
                          "nvlink_pct_of_peak": (100.0 * max(tx or 0.0, rx or 0.0) / 1e9 / link_peak)
                          if link_peak and (tx is not None or rx is not None) else None,
                          "counters": m})
    return CounterAnalysis(device=pm.device, columns=sorted(pm.values), samples=len(pm), interval_us=interval,
                           alignment=align, dram_peak_gbps=dev.dram_gbps if dev else None,
                           nvlink_peak_gbps=link_peak, overall=overall, during_kernels=during,
                           outside_kernels=outside, matmul=matmul, not_matmul=not_matmul, families=fams,
                           collectives=colls)

