"""``aiprof.open(paths)``: a capture's tables as DataFrames and its report as typed objects.

A thin layer over the public functions the CLI uses (``open_capture``, ``build_report``,
``kernel_stats``): it reads their results and computes no metric of its own, so every number
here is the one ``aiprof analyze`` reports. The methods named ``get_*`` are the counterparts of
HolisticTraceAnalysis' ``TraceAnalysis`` methods of the same names (docs/api.md maps them).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Iterable, Optional, Union

from aiprof.analysis.kernels import kernel_stats
from aiprof.api.frame import Frame, arrow_rows, arrow_table
from aiprof.api.report import Report, Step
from aiprof.scale.job_report import capture_report
from aiprof.trace import store
from aiprof.trace.builder import TABLES

if TYPE_CHECKING:
    import pandas as pd

PathArg = Union[str, "os.PathLike[str]"]
_HOST = "host: "  # the report's idle classes (hotspots.classes): GPU idle by what the host was doing


def open(paths: Union[PathArg, Iterable[PathArg]], *, entry: Optional[str] = None, capture: Optional[int] = None,
         top: int = 15, use_cache: bool = True, show_progress: Optional[bool] = None) -> "Capture":
    """Open trace files and/or capture folders (one trace per rank) as one :class:`Capture`.

    ``entry`` names the function / annotation that marks a step (``aiprof analyze --entry``);
    ``capture`` picks the N-th of several torch.profiler cycles of one process (``--capture``);
    ``top``: kernels and hotspots listed per rank in the report (``--top``). Ingest caches a
    columnar store beside each trace (docs/metrics.md, "Tables"), as the CLI does.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    raw = store.open_capture([os.fspath(p) for p in paths], use_cache=use_cache, show_progress=show_progress,
                             capture=capture)
    return Capture(raw, entry=entry, top=top)


def _num(v: object) -> float:
    """A number of the report, NaN where the report has none (unknown is not zero)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 and not math.isnan(part) else math.nan


class Capture:
    """All ranks of one capture: tables (``kernels``, ``ops``, ``runtime``, ``steps``,
    ``collectives``, ``counters``, any store table by ``table(name)``) as :class:`Frame`; the
    report by ``report()``; HTA-style summaries by the ``get_*`` methods (pandas DataFrames)."""

    def __init__(self, raw: store.Capture, entry: Optional[str] = None, top: int = 15) -> None:
        self._raw = raw
        self._entry = entry
        self._top = top
        self._frames: dict[str, Frame] = {}
        self._report: Optional[Report] = None

    def __repr__(self) -> str:
        return f"<aiprof Capture: ranks {self.ranks}, world size {self.world_size}>"

    @property
    def raw(self) -> store.Capture:
        """The underlying ``aiprof.trace.store.Capture`` (numpy columns, per rank)."""
        return self._raw

    @property
    def ranks(self) -> list[int]:
        return [r.rank for r in self._raw.ranks]

    @property
    def world_size(self) -> int:
        return self._raw.world_size

    # ------------------------------------------------------------------ tables
    def table(self, name: str) -> Frame:
        """A table of the store (docs/metrics.md, "Tables"), all ranks, ``rank`` first. Times
        (``ts``, ``dur``, ``t0``, ``t1``) are int64 ns on the trace's clock; -1 is unknown in
        integer columns that the trace may lack (``regs``, ``smem``, ``ext_id``, ...)."""
        if name == "steps":
            return self.steps
        if name not in TABLES:
            raise KeyError(f"no table {name!r}: the tables are {', '.join(TABLES)} (and steps)")
        if name not in self._frames:
            self._frames[name] = Frame.concat(name, [arrow_table(rt.table(name), rt.rank) for rt in self._raw.ranks])
        return self._frames[name]

    @property
    def kernels(self) -> Frame:
        """GPU kernels: ts, dur (ns), device, stream, name, cls (compute|communication), corr, launch geometry."""
        return self.table("kernels")

    @property
    def ops(self) -> Frame:
        """CPU ops (``cpu_op``): ts, dur (ns), pid, tid, name, ext_id, flops, input_dims, input_types."""
        return self.table("ops")

    @property
    def runtime(self) -> Frame:
        """CUDA runtime and driver calls: ts, dur (ns), tid, name, corr, driver."""
        return self.table("runtime")

    @property
    def collectives(self) -> Frame:
        """Collectives (ops, annotations and kernels that carry ``Collective name``), side cpu|gpu."""
        return self.table("collectives")

    @property
    def memops(self) -> Frame:
        """memcpy / memset on the GPU: ts, dur (ns), bytes, kind."""
        return self.table("memops")

    @property
    def counters(self) -> Frame:
        """GPU PM counter samples (``pm.csv.gz`` beside the trace): t0, t1 (ns), device, metric, value
        (the metric's unit is in its name, e.g. ``pm_sm_active_pct``). NVML samples: ``table("hw")``."""
        return self.table("pm")

    @property
    def steps(self) -> Frame:
        """The report's steps, one row per rank and step: the step's window split into compute,
        exposed communication, exposed memory and idle (µs; docs/metrics.md, "Breakdown")."""
        if "steps" not in self._frames:
            rep = self.report()
            cols = ["rank"] + [n for n in Step.__dataclass_fields__ if n != "extra"]
            rows = [{"rank": r.rank, **s.to_dict()} for r in rep.ranks for s in r.steps]
            self._frames["steps"] = Frame("steps", arrow_rows(rows, cols))
        return self._frames["steps"]

    # ------------------------------------------------------------------ report
    def report(self) -> Report:
        """The report (``aiprof analyze``'s, schema aiprof.report/2) as typed objects; computed
        once. ``report().to_dict()`` is the JSON report; in a notebook it shows its causes."""
        if self._report is None:
            # every rank's tables, however many ranks: the frames below read them all
            self._report = Report.from_dict(capture_report(self._raw, self._entry, self._top, detail=None))
        return self._report

    # ------------------------------------------------------------------ HolisticTraceAnalysis counterparts
    def get_temporal_breakdown(self) -> "pd.DataFrame":
        """Per rank, over the analysed steps: GPU compute, non-compute (exposed communication +
        exposed memory) and idle time (µs) and their percentages of the steps' duration. HTA's
        ``get_temporal_breakdown``, measured over the steps (not first to last kernel). A rank
        without GPU activity has NaN, not 0."""
        rows = []
        for r in self.report().ranks:
            s, gpu = r.summary, bool(r.hotspots.get("has_gpu"))
            dur = _num(s.get("duration_us"))
            row = {"rank": r.rank, "steps": int(s.get("steps", 0)), "duration_us": dur}
            for k in ("compute_us", "communication_us", "memory_us", "idle_us"):
                row[k] = _num(s.get(k)) if gpu else math.nan
            row["non_compute_us"] = row["communication_us"] + row["memory_us"]
            for k in ("idle", "compute", "non_compute"):
                row[f"{k}_pctg"] = _pct(row[f"{k}_us"], dur)
            rows.append(row)
        cols = ["rank", "steps", "duration_us", "idle_us", "compute_us", "non_compute_us", "communication_us",
                "memory_us", "idle_pctg", "compute_pctg", "non_compute_pctg"]
        return Frame("temporal_breakdown", arrow_rows(rows, cols)).to_pandas()

    def get_gpu_kernel_breakdown(self) -> "tuple[pd.DataFrame, pd.DataFrame]":
        """HTA's ``get_gpu_kernel_breakdown``: (time per kernel class over all ranks: ``cls``,
        ``total_us``, ``percentage``; every kernel of every rank: ``rank``, ``name``, ``cls``,
        ``calls``, ``total_us``, ``mean_us``, ``median_us``, ``p95_us``, ``share_pct`` of the
        rank's kernel time). Kernel durations summed over the whole trace, as the report's
        ``top_kernels`` (its first rows); memcpy/memset are in ``memops``."""
        per_kernel = []
        for rt in self._raw.ranks:
            per_kernel += [{"rank": rt.rank, **vars(k)} for k in kernel_stats(rt)]
        by_cls: dict[str, float] = {}
        for k in per_kernel:
            by_cls[k["cls"]] = by_cls.get(k["cls"], 0.0) + k["total_us"]
        total = sum(by_cls.values())
        types = [{"cls": c, "total_us": us, "percentage": _pct(us, total)}
                 for c, us in sorted(by_cls.items(), key=lambda kv: -kv[1])]
        kcols = ["rank", "name", "cls", "calls", "total_us", "mean_us", "median_us", "p95_us", "share_pct"]
        return (Frame("kernel_type_breakdown", arrow_rows(types, ["cls", "total_us", "percentage"])).to_pandas(),
                Frame("kernel_breakdown", arrow_rows(per_kernel, kcols)).to_pandas())

    def get_idle_time_breakdown(self) -> "pd.DataFrame":
        """HTA's ``get_idle_time_breakdown``, per rank (not per stream): the GPU's idle time in
        the analysed steps split by what the host's main thread was doing meanwhile
        (``idle_category``: python, op dispatch, cuda runtime, cuda sync, no traced event, data
        loading); ``idle_us``, ``idle_ratio`` (of the rank's idle time) and ``window_ratio`` (of
        the steps' duration: the report's bottleneck ratio). Empty for a rank without GPU."""
        rows = []
        for r in self.report().ranks:
            host = [c for c in r.hotspots.get("classes", []) if c["cls"].startswith(_HOST)]
            idle = sum(c["time_us"] for c in host)
            rows += [{"rank": r.rank, "idle_category": c["cls"][len(_HOST):], "idle_us": c["time_us"],
                      "idle_ratio": c["time_us"] / idle if idle > 0 else math.nan, "window_ratio": c["ratio"]}
                     for c in host]
        cols = ["rank", "idle_category", "idle_us", "idle_ratio", "window_ratio"]
        return Frame("idle_time_breakdown", arrow_rows(rows, cols)).to_pandas()

    def get_comm_comp_overlap(self) -> "pd.DataFrame":
        """HTA's ``get_comm_comp_overlap``: per rank, the share of communication time (GPU,
        over the analysed steps) that compute overlapped, in ``comp_comm_overlap_pctg``; NaN
        for a rank without communication (all NaN without GPU activity)."""
        rows = []
        for r in self.report().ranks:
            gpu = bool(r.hotspots.get("has_gpu"))
            total = _num(r.summary.get("communication_total_us")) if gpu else math.nan
            exposed = _num(r.summary.get("communication_us")) if gpu else math.nan
            rows.append({"rank": r.rank, "communication_us": total, "communication_exposed_us": exposed,
                         "communication_overlapped_us": total - exposed,
                         "comp_comm_overlap_pctg": _pct(total - exposed, total)})
        cols = ["rank", "communication_us", "communication_exposed_us", "communication_overlapped_us",
                "comp_comm_overlap_pctg"]
        return Frame("comm_comp_overlap", arrow_rows(rows, cols)).to_pandas()
