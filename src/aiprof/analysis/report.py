"""A rank's section of the report: every analysis run over one rank, as plain data (schema
aiprof.report/2), and the analyses the diagnosis builds its facts from.

The report as a whole (sections, cross-rank comparison, causes) is assembled by
aiprof.pipeline; reporters (text, JSON, HTML) render it and compute nothing. The schema is
documented in docs/report.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis.breakdown import StepBreakdown, step_breakdown
from aiprof.analysis.comm import CommAnalysis, comm_analysis
from aiprof.analysis.counters import CounterAnalysis, counter_analysis
from aiprof.analysis.diff import diff_steps
from aiprof.analysis.flops import flops_analysis
from aiprof.analysis.hotspots import (
    HOST_CLASSES,
    Gaps,
    HostTree,
    gpu_busy,
    gpu_gaps,
    has_gpu,
    host_tree,
    hotspots,
)
from aiprof.analysis.kernels import (
    KernelAnalysis,
    KernelStat,
    kernel_analysis,
    kernel_stats,
    top_with_other,
)
from aiprof.analysis.memory import memory_from_trace
from aiprof.analysis.native import native_dict
from aiprof.analysis.roofline import roofline
from aiprof.analysis.runtime import RuntimeAnalysis, runtime_analysis
from aiprof.analysis.serving import ServingAnalysis, serving_analysis
from aiprof.analysis.steps import Steps, find_steps, window
from aiprof.analysis.timeseries import gpu_activity, memop_distribution
from aiprof.records import as_dict
from aiprof.trace.store import RankTrace

SCHEMA = "aiprof.report/2"
#: A rank section's tables (kernels, host functions, API calls, FLOPs, the step diff, counters,
#: native calls, roofline): ~46 of the ~50 kB of a 29 MB rank's section, and what a report of
#: many ranks keeps for the ranks its diagnosis names only (pipeline.assemble, docs/report.md
#: "Ranks in brief"); a section without them is "brief". Its other fields (steps, summary,
#: communication, memory, activity) are what the cross-rank comparison and the rank list read.
DETAIL_FIELDS = ("top_kernels", "kernels", "kernels_other", "kernels_by_calls", "runtime", "hotspots", "flops",
                 "step_diff", "counters", "native", "roofline")


def brief(section: dict) -> dict:
    """A rank's report section (a ``ranks`` entry) without its tables (DETAIL_FIELDS)."""
    return {k: v for k, v in section.items() if k not in DETAIL_FIELDS}


def is_brief(section: dict) -> bool:
    """Whether a ``ranks`` entry was kept without its tables (see :func:`brief`)."""
    return "top_kernels" not in section


_SUM_FIELDS = ("duration_us", "compute_us", "communication_us", "memory_us", "idle_us",
               "communication_total_us", "memory_total_us", "runtime_us", "sync_us", "dataloader_us")


@dataclass
class RankReport:
    rank: int
    source: str
    host: str
    device: dict
    step_source: str
    window: dict
    steps: list[StepBreakdown]
    summary: dict
    top_kernels: list[KernelStat]
    rows: dict
    options: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)  # analysis.kernels.KernelAnalysis
    runtime: dict = field(default_factory=dict)  # analysis.runtime.RuntimeAnalysis
    hotspots: dict = field(default_factory=dict)  # analysis.hotspots.Hotspots (+ bottleneck classes)
    communication: dict = field(default_factory=dict)  # analysis.comm.CommAnalysis
    memory: dict = field(default_factory=dict)  # analysis.memory.MemoryAnalysis
    flops: dict = field(default_factory=dict)  # analysis.flops.FlopsAnalysis
    step_diff: dict | None = None  # analysis.diff.StepDiff: median step vs slowest step
    # the dashboard's whole-trace panels (analysis.kernels / analysis.timeseries)
    kernels_other: dict = field(default_factory=dict)  # the kernels after top_kernels: count, calls, time
    kernels_by_calls: dict = field(default_factory=dict)  # top kernels by launches + "other"
    activity: dict = field(default_factory=dict)  # GPU time and count of kernels, memcpy, memset
    memops: list = field(default_factory=list)  # per memcpy/memset name: count, bytes, time
    step_within: str = ""  # the marker steps the iterations were split from (ProfilerStep), if any
    serving: dict | None = None  # analysis.serving.ServingAnalysis: inference traces of a language model
    counters: dict | None = None  # analysis.counters.CounterAnalysis: GPU PM counters per family/collective
    native: dict | None = None  # analysis.native.NativeAnalysis: library calls, NCCL joins, syscalls
    roofline: dict | None = None  # analysis.roofline.Roofline: work vs time per kernel family (GPU ranks)


def _device(rt: RankTrace, gpu: bool) -> dict:
    """The rank's device: ``kind`` "gpu" when the trace names a GPU or ran GPU work, "cpu" when
    neither (a CPU-only capture); ``name`` "" when the trace does not name it."""
    props = rt.meta.get("device_properties") or []
    dev = rt.meta.get("device")
    for p in props:
        if dev is None or p.get("id") == dev:
            return {"id": p.get("id"), "name": p.get("name", ""), "kind": "gpu", "sms": p.get("numSms"),
                    "memory_bytes": p.get("totalGlobalMem"),
                    "compute_capability": f"{p.get('computeMajor', '?')}.{p.get('computeMinor', '?')}"}
    return {"id": dev, "name": "", "kind": "gpu" if gpu else "cpu", "sms": None, "memory_bytes": None,
            "compute_capability": ""}


def summarize(steps: list[StepBreakdown]) -> dict:
    """Totals over the steps, step-time statistics and the overall GPU busy share."""
    if not steps:
        return {}
    tot = {f: float(sum(getattr(s, f) for s in steps)) for f in _SUM_FIELDS}
    durs = np.array([s.duration_us for s in steps])
    busy = tot["duration_us"] - tot["idle_us"]
    tot.update({
        "steps": len(steps),
        "step_mean_us": float(durs.mean()),
        "step_median_us": float(np.median(durs)),
        "step_min_us": float(durs.min()),
        "step_max_us": float(durs.max()),
        "gpu_busy_pct": 100.0 * busy / tot["duration_us"] if tot["duration_us"] > 0 else 0.0,
        "kernels_launched": int(sum(s.kernels_launched for s in steps)),
    })
    return tot


def _step_of(steps: Steps):
    def f(ts: np.ndarray) -> np.ndarray:
        i = steps.index_of(ts)
        return npx.take(steps.number, i, -1)
    return f


@dataclass
class RankAnalyses:
    """The analyses of one rank that the diagnosis builds its facts from (diagnosis.engine.rank_facts)."""

    steps: Steps
    breakdown: list[StepBreakdown]
    tree: HostTree
    gaps: Gaps
    runtime: RuntimeAnalysis
    kernels: KernelAnalysis
    comm: CommAnalysis
    has_gpu: bool
    host_idle_by_class: dict  # analysis.hotspots HOST_CLASSES: GPU-idle time per host class (µs)
    serving: ServingAnalysis | None
    counters: CounterAnalysis | None


def rank_section(rt: RankTrace, entry: str | None = None, top: int = 15,
                 tables: bool = True) -> tuple[RankReport, RankAnalyses]:
    """One rank's report section and the analyses its diagnosis reads. ``tables`` False: the
    section without the tables a brief one drops (DETAIL_FIELDS; ``hotspots`` keeps its classes,
    which the cross-rank comparison reads): a rank of a report of many ranks, whose tables are
    computed only if the report keeps them (scale.job_report): about half the section's CPU
    (docs/scale.md)."""
    steps = find_steps(rt, entry)
    lo, hi = window(rt)
    breakdown = step_breakdown(rt, steps)
    tree = host_tree(rt)
    gpu = has_gpu(rt)
    gaps = gpu_gaps(rt, steps, tree, gpu_busy(rt)) if gpu else gpu_gaps(rt, Steps(steps.number[:0], steps.start[:0], steps.end[:0], steps.source), tree)
    hs = hotspots(rt, steps, top=top, items=tables)
    # the GPU-idle time by host class (the host classes add up to the idle time; the gpu: classes
    # are busy time, no part of it)
    classes = {c.cls: c.time_us for c in hs.classes if c.cls in HOST_CLASSES}
    ka = kernel_analysis(rt, len(steps), top)
    ra = runtime_analysis(rt, steps, top=top)
    ca = comm_analysis(rt, int(steps.start.min()), int(steps.end.max())) if len(steps) else comm_analysis(rt)
    ma = memory_from_trace(rt, _step_of(steps), top=10)
    sv = serving_analysis(rt, steps, breakdown)
    hwc = counter_analysis(rt, [f["family"] for f in ka.families])
    rep = RankReport(
        rank=rt.rank, source=rt.source, host=rt.meta.get("host_name", ""), device=_device(rt, gpu),
        step_source=steps.source,
        window={"start_ns": lo, "end_ns": hi, "duration_us": (hi - lo) / 1000.0},
        steps=breakdown, summary=summarize(breakdown), top_kernels=[],
        rows=rt.meta.get("rows", {}), options=rt.meta.get("options", {}),
        hotspots=as_dict(hs), communication=as_dict(ca), memory=as_dict(ma),
        activity=gpu_activity(rt), memops=memop_distribution(rt),
        step_within=steps.within, serving=as_dict(sv) if sv else None,
    )
    if tables:
        precision = max(ka.precision_us, key=ka.precision_us.get) if ka.precision_us else "bf16"
        if precision in ("unknown", ""):
            known = {k: v for k, v in ka.precision_us.items() if k != "unknown"}
            precision = max(known, key=known.get) if known else "bf16"
        sd = diff_steps(rt, steps=steps, top=top) if len(steps) >= 2 else None
        stats = kernel_stats(rt)
        rep.top_kernels = stats[:top]
        rep.kernels, rep.runtime = as_dict(ka), as_dict(ra)
        rep.flops = as_dict(flops_analysis(rt, steps, precision, gpu))
        rep.step_diff = as_dict(sd) if sd else None
        rep.kernels_other = {**top_with_other(stats, top, "total_us")["other"], "distinct": len(stats)}
        rep.kernels_by_calls = _by_calls(top_with_other(stats, top, "calls"))
        rep.counters = as_dict(hwc) if hwc else None
        rep.native = native_dict(rt, *((int(steps.start.min()), int(steps.end.max())) if len(steps) else (None, None)))
        rep.roofline = as_dict(roofline(rt)) if gpu else None
    return rep, RankAnalyses(steps, breakdown, tree, gaps, ra, ka, ca, gpu, classes, sv, hwc)


def _by_calls(t: dict) -> dict:
    """The top kernels by launches, slim (the full statistics of the top by time are in top_kernels)."""
    return {"top": [{"name": x.name, "cls": x.cls, "calls": x.calls, "total_us": x.total_us} for x in t["top"]],
            "other": t["other"]}


def rank_report(rt: RankTrace, entry: str | None = None, top: int = 15) -> RankReport:
    """Analyse one rank."""
    return rank_section(rt, entry, top)[0]
