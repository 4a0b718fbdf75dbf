"""Build the report: every analysis run over a capture, as plain data (schema aiprof.report/1).

Reporters (text, JSON, HTML) render this and compute nothing. The schema is documented in
docs/report.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from aiprof import __version__
from aiprof.analysis.breakdown import StepBreakdown, step_breakdown
from aiprof.analysis.kernels import KernelStat, kernel_stats
from aiprof.analysis.steps import find_steps, window
from aiprof.trace.store import Capture, RankTrace

SCHEMA = "aiprof.report/1"
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


def _device(rt: RankTrace) -> dict:
    props = rt.meta.get("device_properties") or []
    dev = rt.meta.get("device")
    for p in props:
        if dev is None or p.get("id") == dev:
            return {"id": p.get("id"), "name": p.get("name", ""), "sms": p.get("numSms"),
                    "memory_bytes": p.get("totalGlobalMem"),
                    "compute_capability": f"{p.get('computeMajor', '?')}.{p.get('computeMinor', '?')}"}
    return {"id": dev, "name": "", "sms": None, "memory_bytes": None, "compute_capability": ""}


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


def rank_report(rt: RankTrace, entry: str | None = None, top: int = 15) -> RankReport:
    """Analyse one rank."""
    steps = find_steps(rt, entry)
    lo, hi = window(rt)
    breakdown = step_breakdown(rt, steps)
    return RankReport(
        rank=rt.rank, source=rt.source, host=rt.meta.get("host_name", ""), device=_device(rt),
        step_source=steps.source,
        window={"start_ns": lo, "end_ns": hi, "duration_us": (hi - lo) / 1000.0},
        steps=breakdown, summary=summarize(breakdown), top_kernels=kernel_stats(rt, top),
        rows=rt.meta.get("rows", {}), options=rt.meta.get("options", {}),
    )


def build_report(cap: Capture, entry: str | None = None, top: int = 15) -> dict:
    """The full report of a capture as a JSON-ready dict."""
    ranks = [rank_report(rt, entry, top) for rt in cap.ranks]
    return {
        "schema": SCHEMA,
        "generator": {"name": "aiprof", "version": __version__},
        "capture": {"world_size": cap.world_size, "ranks_found": [r.rank for r in cap.ranks],
                    "sources": [r.source for r in cap.ranks]},
        "ranks": [asdict(r) for r in ranks],
        "findings": [],
    }
