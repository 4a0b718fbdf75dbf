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
from aiprof.analysis.counters import counter_analysis, load_pm
from aiprof.analysis.diff import diff_steps
from aiprof.analysis.hotspots import hotspots
from aiprof.analysis.kernels import kernel_family, kernel_stats, top_with_other
from aiprof.analysis.memory import MemoryAnalysis, load_snapshot, memory_from_snapshot
from aiprof.analysis.ranks import MatchedCollectives, matched_collectives
from aiprof.analysis.report import is_brief, rank_section
from aiprof.analysis.steps import find_steps
from aiprof.analysis.steps import window as steps_window
from aiprof.errors import AiprofError
from aiprof.protocol import COLUMN_UNITS
from aiprof.scale.job_report import capture_report
from aiprof.trace.store import Capture, RankTrace

MAX_ROWS = 5000  # rows a table endpoint returns at most
MAX_FLOWS = 5000  # launch -> GPU arrows per answer: more than a readable screen holds
MAX_COLLECTIVES = 2000  # cross-rank collective links per answer


def _concerns(cause: dict, rank: int) -> bool:
    """A cause belongs on a rank's dashboard when it lives there, is job-wide, or is the
    straggler's cause that this rank waits for."""
    if cause.get("rank") in (None, rank):
        return True
    st = (cause.get("evidence") or {}).get("straggler")
    return isinstance(st, dict) and rank in st.get("waiting_ranks", [])
HW_GPU_UTIL = "gpu_util_pct"
HW_CPU = {"cpu_util_pct": "% of all CPUs", "proc_cpu_pct": "% of one CPU"}  # hw.csv CPU metrics and their units


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
        # every rank's tables: built here, they cost nothing more to keep
        return self._once("report", lambda: capture_report(self.capture, entry=self.entry, detail=None))

    def rank_report(self, r: int) -> dict:
        for rr in self.report()["ranks"]:
            if rr["rank"] == r:
                return rr
        raise BadRequest(f"no rank {r}", 404)

    def rank_detail(self, r: int) -> dict:
        """The rank's report section with its tables. A report of many ranks keeps the tables of
        the ranks its diagnosis names only (pipeline.DETAIL_RANKS): a brief section's are computed
        here from the rank's store when first asked for, then kept."""
        rr = self.rank_report(r)
        if not is_brief(rr):
            return rr
        return self._once(("detail", r), lambda: {**asdict(rank_section(self.rank(r), self.entry)[0]), **rr})

    def index(self, rt: RankTrace) -> timeline.TimelineIndex:
        return self._once(("tl", rt.rank), lambda: timeline.build_index(rt))

    def offset_ns(self, r: int) -> int:
        """What to add to rank ``r``'s timestamps to put them on the common clock: the cross-rank
        analysis's clock offset (``cross_rank.alignment.offset_us``; 0 for one rank)."""
        cross = self.report().get("cross_rank") or {}
        off = ((cross.get("alignment") or {}).get("offset_us") or {}).get(str(r)) or 0.0
        return round(float(off) * 1000.0)

    def origin(self) -> int:
        """Common time origin of all ranks (ns on the aligned clock, the earliest window start):
        the UI shows times after it."""
        return self._once("origin", lambda: min(steps_window(rt)[0] + self.offset_ns(rt.rank) for rt in self.capture.ranks))

    def shift(self, r: int) -> int:
        """UI time = rank ``r``'s own timestamp + this (ns): aligned clock, after the origin."""
        return self.offset_ns(r) - self.origin()

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
            "clock": {"method": ((rep.get("cross_rank") or {}).get("alignment") or {}).get("method", "one rank"),
                      "offset_ns": {str(rt.rank): self.offset_ns(rt.rank) for rt in self.capture.ranks}},
        }

    def overview(self, r: int, k: int = 15) -> dict:
        """Every dashboard panel of one rank, plus the GPU-busy series of every rank by host."""
        k = _clamp(k, 1, 200, "k")
        rt = self.rank(r)
        rr = self.rank_detail(rt.rank)
        rep = self.report()
        s = rr["summary"] or {}
        stats = self._once(("kstats", rt.rank), lambda: kernel_stats(rt))
        # whole-trace panels from the report (computed here only for a report written without them)
        act = rr.get("activity") or timeseries.gpu_activity(rt)
        memops = rr["memops"] if "memops" in rr else timeseries.memop_distribution(rt)
        util = []
        for other in self.capture.ranks:
            w = self.rank_report(other.rank)["window"]
            util.append({"rank": other.rank, "host": other.meta.get("host_name", "") or "host",
                         # the rank's clock offset, so that every rank's series sits on the aligned clock
                         "offset_ns": self.offset_ns(other.rank) - self.offset_ns(rt.rank),
                         **self._once(("busy", other.rank), lambda o=other, w=w: timeseries.gpu_busy_over_time(
                             o, w["start_ns"], w["end_ns"], 200))})
        hw = timeseries.load_hw(rt)
        hw_series = {}
        if hw is not None:
            for (dev, metric), (ts, v) in hw.series.items():
                if metric in HW_CPU:
                    hw_series.setdefault(metric, []).append({"device": dev, "unit": HW_CPU[metric],
                                                             "ts": ts.tolist(), "value": v.tolist()})
        # NVML utilisation of every rank's GPU (each rank samples its own), so the panel shows every GPU
        gpu_hw = []
        for other in self.capture.ranks:
            ohw = timeseries.load_hw(other)
            for (dev, metric), (ts, v) in sorted(ohw.series.items()) if ohw is not None else ():
                if metric == HW_GPU_UTIL:
                    gts, gv = timeseries.with_gaps(ts, v)  # none while PM sampled: a gap, not a held value
                    gpu_hw.append({"rank": other.rank, "host": other.meta.get("host_name", "") or "host", "device": dev,
                                   "offset_ns": self.offset_ns(other.rank) - self.offset_ns(rt.rank),
                                   "ts": gts, "value": gv})
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
                        "distinct": len(stats), "k": k,
                        "by_time": _top(top_with_other(stats, k, "total_us")),
                        "by_calls": _top(top_with_other(stats, k, "calls"))},
            "step_hist": timeseries.histogram([st["duration_us"] for st in rr["steps"]], bins=10),
            "steps": [{"step": st["step"], "duration_us": st["duration_us"]} for st in rr["steps"]],
            "precision_us": rr["kernels"].get("kernel_precision_us", {}),
            "precision_source_us": rr["kernels"].get("kernel_precision_source_us", {}),
            "flops": {key: (rr.get("flops") or {}).get(key) for key in
                      ("source", "total_flops", "tflops_per_s", "mfu_pct", "precision", "peak_tflops",
                       "flops_reason", "mfu_reason")},
            "activity": act,
            "memops": memops,
            "annotations": timeseries.annotation_names(rt)[:200],
        }

    def annotation_hist(self, r: int, name: str, bins: int = 20) -> dict:
        rt = self.rank(r)
        d = timeseries.annotation_durations_us(rt, name)
        if not len(d):
            raise BadRequest(f"no annotation named {name!r} on rank {rt.rank}", 404)
        return {"name": name, "calls": int(len(d)), **timeseries.histogram(d, _clamp(bins, 1, 200, "bins"))}

    def steps(self, r: int) -> dict:
        rr = self.rank_detail(self.rank(r).rank)
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
        rows = [asdict(x) for x in stats[:limit]]
        # the GPU's PM counters during the kernel's family (analysis.counters), where the capture has them
        ca = self._once(("counters", rt.rank), lambda: counter_analysis(rt))
        if ca is not None:
            fams = {f["family"]: f for f in ca.families}
            for row in rows:
                f = fams.get(kernel_family(row["name"]))
                if f is None:
                    continue
                c = f["counters"]
                dram = [c[k] for k in ("pm_dram_read_Bps", "pm_dram_write_Bps") if k in c]
                row.update({"hw_sm_active_pct": c.get("pm_sm_active_pct"), "hw_tensor_active_pct": c.get("pm_tensor_active_pct"),
                            "hw_dram_gbps": sum(dram) / 1e9 if dram else None, "hw_bound": f["bound"],
                            "hw_coverage_pct": f["coverage_pct"]})
        return {"total": len(stats), "rows": rows, "counters": ca is not None}

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
    # Times in and out are UI times: ns on the aligned clock after origin() (see shift()).
    def lanes(self, r: int) -> dict:
        rt = self.rank(r)
        tl = self.index(rt)
        sh = self.shift(rt.rank)
        counters = [{"id": f"mem:{k}", "name": f"GPU memory {k}", "unit": "bytes", "device": "gpu"}
                    for k in timeseries.memory_counters(rt)]
        hw = timeseries.load_hw(rt)
        if hw is not None:
            counters += [{"id": f"hw:{d}:{m}", "name": f"{d} {m}", "device": d,
                          "unit": "bytes" if m.endswith("_bytes") else ""} for d, m in sorted(hw.series)]
        pm = load_pm(rt)
        if pm is not None:  # the GPU's PM counters: drawn under the GPU tracks (web/src/pages/timeline.js)
            counters += [{"id": f"pm:{pm.device}:{m}", "name": f"{pm.device} {m.removeprefix('pm_')}",
                          "device": pm.device, "group": "gpu", "unit": COLUMN_UNITS.get(m, "")}
                         for m in sorted(pm.values)]
        return {"rank": rt.rank, "origin_ns": self.origin(), "offset_ns": self.offset_ns(rt.rank),
                "start": tl.start_ns + sh, "end": tl.end_ns + sh, "host": rt.meta.get("host_name", "") or "",
                "events": tl.events, "lanes": timeline.lanes_info(tl), "counters": counters,
                "processes": {str(k): v for k, v in tl.processes.items()},
                "hw": hw.path if hw else None, "sources": list(timeline.SOURCES)}

    def window(self, r: int, t0: float, t1: float, px: int, lanes: list[int] | None = None) -> dict:
        rt = self.rank(r)
        if not (np.isfinite(t0) and np.isfinite(t1)) or t1 <= t0:
            raise BadRequest("need t0 < t1")
        px = _clamp(px, 1, timeline.MAX_PX, "px")
        sh = self.shift(rt.rank)
        return timeline.window(self.index(rt), int(t0) - sh, int(t1) - sh, px, lanes, origin=-sh)

    def counters(self, r: int, t0: float, t1: float, px: int) -> dict:
        rt = self.rank(r)
        if t1 <= t0:
            raise BadRequest("need t0 < t1")
        px = _clamp(px, 1, timeline.MAX_PX, "px")
        sh = self.shift(rt.rank)
        a, b = int(t0) - sh, int(t1) - sh
        out = {}
        for k, (ts, v) in timeseries.memory_counters(rt).items():
            d = timeseries.downsample(ts, v, a, b, px)
            out[f"mem:{k}"] = {"ts": [t + sh for t in d["ts"]], "value": d["value"], "before": d["before"]}
        hw = timeseries.load_hw(rt)
        if hw is not None:
            for (dev, m), (ts, v) in hw.series.items():
                d = timeseries.downsample(ts, v, a, b, px, how="mean")
                out[f"hw:{dev}:{m}"] = {"ts": [t + sh for t in d["ts"]], "value": d["value"], "before": d["before"],
                                        "after": d["after"]}
        pm = load_pm(rt)
        if pm is not None:  # level of detail as for kernels: the mean of the samples in each pixel
            for m, v in pm.values.items():
                d = timeseries.downsample(pm.t0, v, a, b, px, how="mean")
                out[f"pm:{pm.device}:{m}"] = {"ts": [t + sh for t in d["ts"]], "value": d["value"],
                                              "before": d["before"], "after": d["after"]}
        return {"counters": out}

    def _ui_ref(self, ref: dict | None, sh: int) -> dict | None:
        if ref:
            ref["start"] += sh
            ref["end"] += sh
        return ref

    def event(self, r: int, source: str, row: int) -> dict:
        rt = self.rank(r)
        tl = self.index(rt)
        try:
            d = timeline.event_detail(rt, tl, source, row)
        except KeyError:
            raise BadRequest(f"unknown source {source!r} (one of {', '.join(timeline.SOURCES)})") from None
        except IndexError:
            raise BadRequest(f"no row {row} in {source}", 404) from None
        sh = self.shift(rt.rank)
        for key in ("ref", "launch", "op"):
            self._ui_ref(d.get(key), sh)
        for x in d.get("launched", []):
            self._ui_ref(x, sh)
        d["rank"] = rt.rank
        if source in ("kernels", "annotations", "ops") and d.get("ref"):
            d["collective"] = self._collective_of(rt.rank, d["ref"])
        return d

    def search(self, r: int, q: str, limit: int = 100) -> dict:
        if not q.strip():
            raise BadRequest("empty search")
        rt = self.rank(r)
        res = timeline.search(self.index(rt), q.strip(), _clamp(limit, 1, 1000, "limit"))
        sh = self.shift(rt.rank)
        for e in res["events"]:
            self._ui_ref(e, sh)
        return res

    def next_event(self, r: int, source: str, row: int, direction: int) -> dict:
        """The next/previous event with the same name (UI times); ``{"event": null}`` when none."""
        rt = self.rank(r)
        if source not in timeline.SOURCES:
            raise BadRequest(f"unknown source {source!r} (one of {', '.join(timeline.SOURCES)})")
        ev = timeline.next_occurrence(self.index(rt), source, row, 1 if direction >= 0 else -1)
        return {"event": self._ui_ref(ev, self.shift(rt.rank))}

    def flows(self, r: int, t0: float, t1: float, limit: int = 2000) -> dict:
        rt = self.rank(r)
        if not (np.isfinite(t0) and np.isfinite(t1)) or t1 <= t0:
            raise BadRequest("need t0 < t1")
        sh = self.shift(rt.rank)
        return timeline.flows(rt, self.index(rt), int(t0) - sh, int(t1) - sh, _clamp(limit, 1, MAX_FLOWS, "limit"),
                              origin=-sh)

    def matched(self) -> MatchedCollectives:
        cross = self.report().get("cross_rank") or {}
        return self._once("matched", lambda: matched_collectives(
            self.capture, (cross.get("alignment") or {}).get("offset_us") or {}))

    def collectives(self, t0: float, t1: float, limit: int = 500) -> dict:
        """Collectives matched across ranks that overlap ``[t0, t1)`` (UI times): per collective its
        event on every rank that took part, who arrived last and the wait that alone caused."""
        if not (np.isfinite(t0) and np.isfinite(t1)) or t1 <= t0:
            raise BadRequest("need t0 < t1")
        limit = _clamp(limit, 1, MAX_COLLECTIVES, "limit")
        m = self.matched()
        o = self.origin()
        if not m.start.shape[1]:
            return {"collectives": [], "total": 0, "truncated": False}
        with np.errstate(invalid="ignore"):
            lo = np.nanmin(m.start, axis=0) - o
            hi = np.nanmax(m.end, axis=0) - o
        cols = np.nonzero((hi > t0) & (lo < t1))[0]
        cols = cols[np.argsort(lo[cols], kind="stable")]
        events = self._once("matched_events", lambda: self._collective_events(m))
        out = []
        for j in cols[:limit].tolist():
            parts = []
            for i, r in enumerate(m.ranks):
                if m.local_start[i, j] < 0:
                    continue
                sh = self.shift(r)
                ev = events[i][j]
                parts.append({"rank": r, "start": int(m.local_start[i, j]) + sh, "end": int(m.local_end[i, j]) + sh,
                              "event": self._ui_ref(dict(ev), sh) if ev else None})
            out.append({"id": j, "pg": m.pg[j], "sig": m.sig[j], "step": int(m.step[j]),
                        "last_rank": m.ranks[int(m.last[j])], "caused_us": float(m.caused_ns[j]) / 1000.0,
                        "ranks": parts})
        return {"collectives": out, "total": len(cols), "truncated": len(cols) > limit}

    def _collective_events(self, m: MatchedCollectives) -> list[list[dict | None]]:
        """Per rank and matched collective, its event on the timeline (own clock), found once."""
        out = []
        for i, r in enumerate(m.ranks):
            tl = self.index(self.rank(r))
            group = "host" if m.side.get(r) == "cpu" else "gpu"
            out.append([timeline.find_at(tl, group, int(m.local_start[i, j]), int(m.local_end[i, j]))
                        if m.local_start[i, j] >= 0 else None for j in range(m.start.shape[1])])
        return out

    def _collective_of(self, r: int, ref: dict) -> dict | None:
        """The matched collective whose event on rank ``r`` is ``ref`` (UI times), if any."""
        m = self.matched()
        if r not in m.ranks or not m.start.shape[1]:
            return None
        i = m.ranks.index(r)
        local = ref["start"] - self.shift(r)
        hit = np.nonzero(m.local_start[i] == local)[0]
        if not len(hit):
            return None
        res = self.collectives(ref["start"], ref["end"], MAX_COLLECTIVES)
        return next((c for c in res["collectives"] if c["id"] == int(hit[0])), None)

    # ------------------------------------------------------------------ memory
    def memory(self, r: int, px: int = 1200) -> dict:
        rt = self.rank(r)
        rr = self.rank_report(rt.rank)
        o = -self.shift(rt.rank)  # UI time = own time - o
        w = rr["window"]
        px = _clamp(px, 10, 4000, "px")
        series = {}
        for k, (ts, v) in timeseries.memory_counters(rt).items():
            d = timeseries.downsample(ts, v, int(ts[0]), int(ts[-1]) + 1, px)
            series[k] = {"ts": [t - o for t in d["ts"]], "value": d["value"]}
        nvml = timeseries.hw_memory(timeseries.load_hw(rt), w["start_ns"], w["end_ns"] + 1, px)
        for x in nvml:
            x["ts"] = [t - o for t in x["ts"]]
            x["peak_ts"] -= o
        snap = None
        if self.memory_snapshot:
            ma: MemoryAnalysis = self._once(("snap", self.memory_snapshot), lambda: memory_from_snapshot(
                load_snapshot(self.memory_snapshot), device=int(rr["device"].get("id") or 0), top=20))
            snap = {"file": self.memory_snapshot, **asdict(ma)}
        steps = [{"step": st["step"], "start": st["start_ns"] - o, "end": st["start_ns"] - o + st["duration_us"] * 1000}
                 for st in rr["steps"]]
        return {"rank": rt.rank, "memory": rr["memory"], "series": series, "hw": nvml, "snapshot": snap, "steps": steps,
                "window": {"start": w["start_ns"] - o, "end": w["end_ns"] - o},
                "device_memory_bytes": rr["device"].get("memory_bytes")}


def _top(t: dict) -> dict:
    return {"by": t["by"], "top": [asdict(x) for x in t["top"]], "other": t["other"]}


def _clamp(v: Any, lo: int, hi: int, name: str) -> int:
    try:
        iv = int(v)
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be an integer") from None
    if not lo <= iv <= hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}")
    return iv
