"""What the UI pages show, assembled from the report and the analyses (no metric is computed
here: every number comes from ``aiprof.analysis``). Shared by the live app (server/app.py) and
the static ``analyze --html`` report (server/static_report.py).
"""
from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from aiprof.analysis import links, timeline, timeseries
from aiprof.analysis.diff import diff_steps
from aiprof.analysis.hotspots import hotspots
from aiprof.analysis.kernels import kernel_stats
from aiprof.analysis.memory import MemoryAnalysis, load_snapshot, memory_from_snapshot
from aiprof.analysis.report import build_report
from aiprof.analysis.steps import find_steps
from aiprof.analysis.steps import window as steps_window
from aiprof.errors import AiprofError
from aiprof.trace.store import Capture, RankTrace

MAX_ROWS = 5000  # rows a table endpoint returns at most


def _concerns(cause: dict, rank: int) -> bool:
    """A cause belongs on a rank's dashboard when it lives there, is job-wide, or is the
    straggler's cause that this rank waits for."""
    if cause.get("rank") in (None, rank):
        return True
    st = (cause.get("evidence") or {}).get("straggler")
    return isinstance(st, dict) and rank in st.get("waiting_ranks", [])
HW_GPU_UTIL = "gpu_util_pct"
HW_CPU = ("cpu_util_pct", "proc_cpu_pct")


class BadRequest(AiprofError):
    """A request the API cannot answer (bad parameter, unknown rank/step): HTTP 4xx."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class CaptureData:
    """A capture plus lazily built, memoised report and per-rank analyses (thread safe)."""

    def __init__(self, capture: Capture, entry: str | None = None, memory_snapshot: str | None = None,
                 report: dict | None = None) -> None:
        """``report``: the capture's report when it is already built (the service's analysis
        wrote it), so that opening the UI does not analyse the capture a second time."""
        self.capture = capture
        self.entry = entry
        self.memory_snapshot = memory_snapshot
        self._lock = threading.RLock()
        self._memo: dict[Any, Any] = {} if report is None else {"report": report}

    def _once(self, key: Any, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._memo:
                self._memo[key] = fn()
            return self._memo[key]

    # ------------------------------------------------------------------ lookups
    def rank(self, r: int | None) -> RankTrace:
        if r is None:
            return self.capture.ranks[0]
        try:
            return self.capture.rank(int(r))
        except KeyError:
            raise BadRequest(f"no rank {r} (ranks: {', '.join(str(t.rank) for t in self.capture.ranks)})",
                             404) from None

    def report(self) -> dict:
        return self._once("report", lambda: build_report(self.capture, entry=self.entry))

    def rank_report(self, r: int) -> dict:
        for rr in self.report()["ranks"]:
            if rr["rank"] == r:
                return rr
        raise BadRequest(f"no rank {r}", 404)

    def index(self, rt: RankTrace) -> timeline.TimelineIndex:
        return self._once(("tl", rt.rank), lambda: timeline.build_index(rt))

    def origin(self) -> int:
        """Common time origin of all ranks (ns, the report's window start): the UI shows times
        after it. Not taken from the report so that the timeline needs no full analysis."""
        return self._once("origin", lambda: min(steps_window(rt)[0] for rt in self.capture.ranks))

    # ------------------------------------------------------------------ pages
    def meta(self) -> dict:
        rep = self.report()
        return {
            "world_size": rep["capture"]["world_size"],
            "origin_ns": self.origin(),
            "ranks": [{"rank": r["rank"], "source": r["source"], "host": r["host"], "device": r["device"],
                       "step_source": r["step_source"], "steps": [s["step"] for s in r["steps"]],
                       "rows": r["rows"], "hw": timeseries.hw_path(self.rank(r["rank"])) is not None}
                      for r in rep["ranks"]],
            "causes": len(rep["causes"]),
            "memory_snapshot": self.memory_snapshot,
        }

    def overview(self, r: int, k: int = 15) -> dict:
        """Every dashboard panel of one rank, plus the GPU-busy series of every rank by host."""
        k = _clamp(k, 1, 200, "k")
        rt = self.rank(r)
        rr = self.rank_report(rt.rank)
        rep = self.report()
        s = rr["summary"] or {}
        stats = self._once(("kstats", rt.rank), lambda: kernel_stats(rt))
        act = timeseries.gpu_activity(rt)
        util = []
        for other in self.capture.ranks:
            w = self.rank_report(other.rank)["window"]
            util.append({"rank": other.rank, "host": other.meta.get("host_name", "") or "host",
                         **self._once(("busy", other.rank), lambda o=other, w=w: timeseries.gpu_busy_over_time(
                             o, w["start_ns"], w["end_ns"], 200))})
        hw = timeseries.load_hw(rt)
        hw_series = {}
        if hw is not None:
            for (dev, metric), (ts, v) in hw.series.items():
                if metric in HW_CPU:
                    hw_series.setdefault(metric, []).append({"device": dev, "ts": ts.tolist(), "value": v.tolist()})
        # NVML utilisation of every rank's GPU (each rank samples its own), so the panel shows every GPU
        gpu_hw = []
        for other in self.capture.ranks:
            ohw = timeseries.load_hw(other)
            for (dev, metric), (ts, v) in sorted(ohw.series.items()) if ohw is not None else ():
                if metric == HW_GPU_UTIL:
                    gpu_hw.append({"rank": other.rank, "host": other.meta.get("host_name", "") or "host", "device": dev,
                                   "ts": ts.tolist(), "value": v.tolist()})
        return {
            "rank": rt.rank, "device": rr["device"], "host": rr["host"], "step_source": rr["step_source"],
            "window": rr["window"], "summary": s,
            "causes": [c for c in rep["causes"] if _concerns(c, rt.rank)],
            "symptoms": [s for s in rep["symptoms"] if s.get("rank") in (None, rt.rank)],
            "all_causes": len(rep["causes"]),
            "baseline": next((b for b in rep.get("baseline", []) if b["rank"] == rt.rank), None),
            "gpu": {"busy_us": s.get("duration_us", 0.0) - s.get("idle_us", 0.0), "idle_us": s.get("idle_us", 0.0),
                    "busy_pct": s.get("gpu_busy_pct", 0.0)},
            "gpu_util": util,
            "hw": {"file": hw.path if hw else None, "gpu_util": gpu_hw,
                   "cpu": [dict(x, metric=m) for m in HW_CPU for x in hw_series.get(m, [])],
                   "cpu_active": timeseries.cpu_active_idle(hw, rr["window"]["start_ns"], rr["window"]["end_ns"])},
            "kernels": {"total_us": act["kernels"]["time_us"], "launches": act["kernels"]["count"],
                        "distinct": len(stats), "top": [asdict(x) for x in stats[:k]], "k": k},
            "step_hist": timeseries.histogram([st["duration_us"] for st in rr["steps"]], bins=10),
            "steps": [{"step": st["step"], "duration_us": st["duration_us"]} for st in rr["steps"]],
            "precision_us": rr["kernels"].get("precision_us", {}),
            "activity": act,
            "memops": timeseries.memop_distribution(rt),
            "annotations": timeseries.annotation_names(rt)[:200],
        }

    def annotation_hist(self, r: int, name: str, bins: int = 20) -> dict:
        rt = self.rank(r)
        d = timeseries.annotation_durations_us(rt, name)
        if not len(d):
            raise BadRequest(f"no annotation named {name!r} on rank {rt.rank}", 404)
        return {"name": name, "calls": int(len(d)), **timeseries.histogram(d, _clamp(bins, 1, 200, "bins"))}

    def steps(self, r: int) -> dict:
        rr = self.rank_report(self.rank(r).rank)
        return {"rank": rr["rank"], "step_source": rr["step_source"], "steps": rr["steps"],
                "default_diff": rr.get("step_diff")}

    def serving(self, r: int) -> dict:
        """The rank's serving section (analysis/serving.py; null for training traces)."""
        rr = self.rank_report(self.rank(r).rank)
        return {"rank": rr["rank"], "step_source": rr["step_source"], "step_within": rr.get("step_within", ""),
                "serving": rr.get("serving")}

    def diff(self, r: int, base: int, compare: int) -> dict:
        rt = self.rank(r)
        try:
            return asdict(diff_steps(rt, base=base, compare=compare, top=50))
        except AiprofError as exc:
            raise BadRequest(str(exc)) from None

    def kernels(self, r: int, limit: int = MAX_ROWS) -> dict:
        rt = self.rank(r)
        stats = self._once(("kstats", rt.rank), lambda: kernel_stats(rt))
        limit = _clamp(limit, 1, MAX_ROWS, "limit")
        return {"total": len(stats), "rows": [asdict(x) for x in stats[:limit]]}

    def host_table(self, r: int, kind: str, limit: int = MAX_ROWS) -> dict:
        if kind not in ("python", "op", "annotation", "runtime"):
            raise BadRequest("kind must be python, op, annotation or runtime")
        rt = self.rank(r)
        hs = self._once(("hotspots", rt.rank), lambda: hotspots(rt, find_steps(rt, self.entry), top=1_000_000))
        rows = [asdict(i) for i in hs.items if i.kind == kind]
        rows.sort(key=lambda x: -x["inclusive_us"])
        limit = _clamp(limit, 1, MAX_ROWS, "limit")
        return {"total": len(rows), "rows": rows[:limit]}

    def links(self, r: int, kind: str, name: str) -> dict:
        rt = self.rank(r)
        if kind == "kernel":
            return links.launchers(rt, name)
        if kind in ("python", "op"):
            return links.under(rt, kind, name)
        raise BadRequest("kind must be python, op or kernel")

    def ranks(self) -> dict:
        rep = self.report()
        rows = []
        for rr in rep["ranks"]:
            rows.append({"rank": rr["rank"], "host": rr["host"], "summary": rr["summary"],
                         "steps": [{k: st[k] for k in ("step", "duration_us", "compute_us", "communication_us",
                                                        "communication_total_us", "idle_us")} for st in rr["steps"]],
                         "communication": rr["communication"]})
        flagged = {}
        for c in rep["causes"]:
            st = (c.get("evidence") or {}).get("straggler")
            if isinstance(st, dict):
                flagged.setdefault(int(st["rank"]), set()).add("straggler")
                for w in st.get("waiting_ranks", []):
                    flagged.setdefault(int(w), set()).add("waiting")
        cross = rep.get("cross_rank") or {}
        for k, v in (cross.get("flags") or {}).items():  # straggler / waiting / abnormal (analysis.ranks)
            flagged.setdefault(int(k), set()).update(v)
        return {"ranks": rows, "flags": {str(k): sorted(v) for k, v in flagged.items()},
                "matrix": cross.get("matrix"), "missing_ranks": cross.get("missing_ranks", []),
                "causes": [c for c in rep["causes"] if c.get("rank") is None or "straggler" in (c.get("evidence") or {})],
                "symptoms": [s for s in rep["symptoms"] if s["code"] in ("WAITING_RANK", "EXPOSED_COMM")]}

    # ------------------------------------------------------------------ timeline
    def lanes(self, r: int) -> dict:
        rt = self.rank(r)
        tl = self.index(rt)
        o = self.origin()
        counters = [{"id": f"mem:{k}", "name": f"GPU memory {k}", "unit": "bytes"}
                    for k in timeseries.memory_counters(rt)]
        hw = timeseries.load_hw(rt)
        if hw is not None:
            counters += [{"id": f"hw:{d}:{m}", "name": f"{d} {m}", "unit": "bytes" if m.endswith("_bytes") else ""}
                         for d, m in sorted(hw.series)]
        return {"rank": rt.rank, "origin_ns": o, "start": tl.start_ns - o, "end": tl.end_ns - o,
                "events": tl.events, "lanes": timeline.lanes_info(tl), "counters": counters,
                "hw": hw.path if hw else None, "sources": list(timeline.SOURCES)}

    def window(self, r: int, t0: float, t1: float, px: int, lanes: list[int] | None = None) -> dict:
        rt = self.rank(r)
        if not (np.isfinite(t0) and np.isfinite(t1)) or t1 <= t0:
            raise BadRequest("need t0 < t1")
        px = _clamp(px, 1, timeline.MAX_PX, "px")
        o = self.origin()
        return timeline.window(self.index(rt), int(t0) + o, int(t1) + o, px, lanes, origin=o)

    def counters(self, r: int, t0: float, t1: float, px: int) -> dict:
        rt = self.rank(r)
        if t1 <= t0:
            raise BadRequest("need t0 < t1")
        px = _clamp(px, 1, timeline.MAX_PX, "px")
        o = self.origin()
        a, b = int(t0) + o, int(t1) + o
        out = {}
        for k, (ts, v) in timeseries.memory_counters(rt).items():
            d = timeseries.downsample(ts, v, a, b, px)
            out[f"mem:{k}"] = {"ts": [t - o for t in d["ts"]], "value": d["value"], "before": d["before"]}
        hw = timeseries.load_hw(rt)
        if hw is not None:
            for (dev, m), (ts, v) in hw.series.items():
                d = timeseries.downsample(ts, v, a, b, px, how="mean")
                out[f"hw:{dev}:{m}"] = {"ts": [t - o for t in d["ts"]], "value": d["value"], "before": d["before"],
                                        "after": d["after"]}
        return {"counters": out}

    def event(self, r: int, source: str, row: int) -> dict:
        rt = self.rank(r)
        tl = self.index(rt)
        try:
            d = timeline.event_detail(rt, tl, source, row)
        except KeyError:
            raise BadRequest(f"unknown source {source!r} (one of {', '.join(timeline.SOURCES)})") from None
        except IndexError:
            raise BadRequest(f"no row {row} in {source}", 404) from None
        o = self.origin()
        for key in ("ref", "launch", "op"):
            if d.get(key):
                d[key]["start"] -= o
                d[key]["end"] -= o
        for x in d.get("launched", []):
            x["start"] -= o
            x["end"] -= o
        return d

    def search(self, r: int, q: str, limit: int = 100) -> dict:
        if not q.strip():
            raise BadRequest("empty search")
        rt = self.rank(r)
        res = timeline.search(self.index(rt), q.strip(), _clamp(limit, 1, 1000, "limit"))
        o = self.origin()
        for e in res["events"]:
            e["start"] -= o
            e["end"] -= o
        return res

    # ------------------------------------------------------------------ memory
    def memory(self, r: int, px: int = 1200) -> dict:
        rt = self.rank(r)
        rr = self.rank_report(rt.rank)
        o = self.origin()
        w = rr["window"]
        series = {}
        for k, (ts, v) in timeseries.memory_counters(rt).items():
            d = timeseries.downsample(ts, v, int(ts[0]), int(ts[-1]) + 1, _clamp(px, 10, 4000, "px"))
            series[k] = {"ts": [t - o for t in d["ts"]], "value": d["value"]}
        snap = None
        if self.memory_snapshot:
            ma: MemoryAnalysis = self._once(("snap", self.memory_snapshot), lambda: memory_from_snapshot(
                load_snapshot(self.memory_snapshot), device=int(rr["device"].get("id") or 0), top=20))
            snap = {"file": self.memory_snapshot, **asdict(ma)}
        steps = [{"step": st["step"], "start": st["start_ns"] - o, "end": st["start_ns"] - o + st["duration_us"] * 1000}
                 for st in rr["steps"]]
        return {"rank": rt.rank, "memory": rr["memory"], "series": series, "snapshot": snap, "steps": steps,
                "window": {"start": w["start_ns"] - o, "end": w["end_ns"] - o},
                "device_memory_bytes": rr["device"].get("memory_bytes")}


def _clamp(v: Any, lo: int, hi: int, name: str) -> int:
    try:
        iv = int(v)
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be an integer") from None
    if not lo <= iv <= hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}")
    return iv
