"""Level-of-detail (LOD) timeline index for the web UI: lanes of non-overlapping slices and
window queries whose cost depends on the pixels asked for, not on the events in the window.

A *lane* is one row of the timeline: a host thread at one nesting depth (Python frames, ops,
annotations and runtime calls, nested by :func:`aiprof.analysis.hotspots.host_tree`), one GPU
stream (kernels, memcpy, memset; the rare overlapping GPU events get an "overlap" lane, never
a clipped duration), the GPU-side annotations of a stream (one lane per nesting depth), the sync
events of a stream (``cuda_sync``: stream/event/context waits), or the steps band. Slices in a lane do not overlap, so a lane sorted by
start is also sorted by (running-max) end, and a window is two binary searches.

:func:`window` answers "what to draw for ``[t0, t1)`` at ``px`` pixels": in a lane with few
events in the window every event is returned; otherwise only the events at least one pixel
wide (found through per-lane duration levels, so never scanning the window) plus one summary
per pixel column (events starting there and the fraction of it they cover, from prefix sums).
Per lane the work is O(px log n) whatever the number of events in the window.

Times in the index are absolute ns (trace clock); the API converts to an origin.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import (
    ANNOTATION,
    OP,
    PYTHON,
    RUNTIME,
    HostTree,
    host_tree,
)
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.memo import analysis_cache
from aiprof.analysis.nesting import nest
from aiprof.analysis.steps import find_steps
from aiprof.trace.store import RankTrace

SOURCES = ("python", "ops", "runtime", "annotations", "kernels", "memops", "steps", "gpu_sync", "calls", "syscalls")
_TREE_KIND_TO_SOURCE = {PYTHON: 0, OP: 1, RUNTIME: 2, ANNOTATION: 3}
# Duration levels (ns): level k holds the events with dur >= 1 µs * 4**k. A query at b ns per
# pixel reads the level just below b, which holds at most ~4 events per pixel column.
LEVEL_NS = np.array([1000 * 4 ** k for k in range(14)], dtype=np.int64)
MAX_PX = 8192  # a window query never asks for more columns than a very wide screen has
FULL_DETAIL_MIN = 256  # a lane with at most max(this, px / 4) events in the window is sent whole


@dataclass
class Lane:
    """One timeline row; arrays sorted by start."""

    id: int
    group: str  # steps | host | gpu | native (traced library calls, sampled syscalls)
    track: str  # e.g. "thread 123 (python)" or "GPU 0 stream 7"
    depth: int
    start: np.ndarray
    end: np.ndarray
    name: np.ndarray  # code into TimelineIndex.labels
    source: np.ndarray  # index into SOURCES
    row: np.ndarray  # row in the source table
    kind: str = ""  # what the lane holds, for its label: "annotations", "kernels / memcpy", "sync"; "" = by group
    proc: int = -1  # where it sits in the hierarchy: host lanes: process id; GPU lanes: device
    thread: int = -1  # host lanes: thread id; GPU lanes: stream
    endmax: np.ndarray = field(repr=False, default=None)  # running max of end (sorted)
    cum: np.ndarray = field(repr=False, default=None)  # prefix sums of duration, len n+1
    levels: list[np.ndarray] = field(repr=False, default_factory=list)

    def __len__(self) -> int:
        return len(self.start)

    def finish(self) -> "Lane":
        order = np.argsort(self.start, kind="stable")
        for k in ("start", "end", "name", "source", "row"):
            setattr(self, k, getattr(self, k)[order])
        dur = self.end - self.start
        self.endmax = np.maximum.accumulate(self.end) if len(self.end) else self.end
        self.cum = np.concatenate([[0], np.cumsum(dur)]).astype(np.int64)
        self.levels = []
        for t in LEVEL_NS:
            idx = np.nonzero(dur >= t)[0]
            self.levels.append(idx)
            if not len(idx):
                break
        return self


@dataclass
class TimelineIndex:
    """All lanes of one rank plus where each source row ended up."""

    rank: int
    lanes: list[Lane]
    labels: list[str]
    start_ns: int
    end_ns: int
    # per source table: lane id and position in the lane of each row (-1 = not on the timeline)
    where: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    tree: HostTree | None = field(default=None, repr=False)
    processes: dict[int, str] = field(default_factory=dict)  # host process id -> its name in the trace

    @property
    def events(self) -> int:
        return int(sum(len(l) for l in self.lanes))

    def locate(self, source: str, row: int) -> tuple[int, int]:
        """(lane id, position) of a source row, or (-1, -1)."""
        w = self.where.get(source)
        if w is None or not 0 <= row < len(w[0]):
            return -1, -1
        return int(w[0][row]), int(w[1][row])


def _thread_labels(rt: RankTrace) -> dict[int, str]:
    th = rt.threads
    if not len(th):
        return {}
    return {int(t): str(n) for t, n in zip(th["tid"], th["name"]) if t >= 0 and str(n)}


def _thread_process(rt: RankTrace) -> tuple[dict[int, int], dict[int, str]]:
    """Host thread id -> process id (from the trace's thread metadata, else from its ops and
    Python events), and process id -> process name."""
    pid_of: dict[int, int] = {}
    names: dict[int, str] = {}
    th = rt.threads
    if len(th):
        nm = th.strings("name") if hasattr(th.columns["name"], "labels") else None
        for i, (p, t) in enumerate(zip(th["pid"].tolist(), th["tid"].tolist())):
            if t >= 0:
                pid_of.setdefault(int(t), int(p))
            elif nm is not None:
                names.setdefault(int(p), nm.labels[nm.codes[i]])
    for tname in ("ops", "python", "runtime", "annotations"):
        t = rt.table(tname)
        if len(t) and "pid" in t.columns and "tid" in t.columns:
            tids, pids, _ = npx.unique_pairs(t["tid"].astype(np.int64), t["pid"].astype(np.int64))
            for tid, pid in zip(tids.tolist(), pids.tolist()):
                pid_of.setdefault(int(tid), int(pid))
    return pid_of, names


class _Labels:
    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def remap(self, labels: list[str]) -> np.ndarray:
        return np.array([self.index.setdefault(s, len(self.index)) for s in labels]
                        + [self.index.setdefault("", len(self.index))], dtype=np.int32)

    def list(self) -> list[str]:
        return list(self.index)


def build_index(rt: RankTrace) -> TimelineIndex:
    """Build the lanes of one rank (cached on the rank object)."""
    cache = analysis_cache(rt)
    if "timeline_index" in cache:
        return cache["timeline_index"]
    labels = _Labels()
    lanes: list[Lane] = []
    where: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    st = find_steps(rt)
    for s in SOURCES:
        n = len(st) if s == "steps" else len(rt.table(s))
        where[s] = (np.full(n, -1, np.int32), np.full(n, -1, np.int64))

    def add(lane: Lane) -> None:
        lane.finish()
        lanes.append(lane)
        for si in npx.unique(lane.source).tolist():
            m = lane.source == si
            src = SOURCES[si]
            if src in where:
                where[src][0][lane.row[m]] = lane.id
                where[src][1][lane.row[m]] = np.nonzero(m)[0]

    # steps band
    if len(st) and st.source != "window":
        names = labels.remap([f"step {n}" for n in st.number.tolist()])
        add(Lane(len(lanes), "steps", "steps", 0, st.start.astype(np.int64), np.maximum(st.end, st.start + 1),
                 names[np.arange(len(st))], np.full(len(st), SOURCES.index("steps"), np.int8),
                 np.arange(len(st), dtype=np.int64)))
    # host threads: the analyses' call tree, one lane per (thread, depth)
    tree = host_tree(rt)
    if len(tree):
        code_map = labels.remap(tree.labels)
        tlabels = _thread_labels(rt)
        pid_of, proc_names = _thread_process(rt)
        src_of_kind = np.array([_TREE_KIND_TO_SOURCE[k] for k in range(4)], np.int8)
        key = tree.tid.astype(np.int64)
        for tid in npx.unique(key).tolist():
            m_t = key == tid
            depths = tree.depth[m_t]
            label = tlabels.get(tid) or f"thread {tid}"
            if tid == tree.main_tid:
                label += " · main"
            idx_t = np.nonzero(m_t)[0]
            for d in npx.unique(depths).tolist():
                idx = idx_t[depths == d]
                add(Lane(len(lanes), "host", label, int(d), tree.start[idx], tree.end[idx], code_map[tree.code[idx]],
                         src_of_kind[tree.kind[idx]], tree.row[idx].astype(np.int64), proc=pid_of.get(tid, -1),
                         thread=int(tid)))
    # GPU streams: per (device, stream), the GPU-side annotations (nested by depth), the work
    # (kernels, memcpy, memset; overlaps get extra lanes) and the sync events, in that order
    groups = {"annotations": [], "work": [], "sync": []}
    for s, g in (("kernels", "work"), ("memops", "work"), ("gpu_sync", "sync"), ("annotations", "annotations")):
        t = rt.table(s)
        if not len(t):
            continue
        if s == "annotations":  # Kineto's gpu_user_annotation: pid = device, tid = stream
            rows = np.nonzero(t["gpu"])[0]
            dev, stream = t["pid"][rows], t["tid"][rows]
        else:
            rows = np.arange(len(t))
            dev, stream = t["device"], t["stream"]
        if not len(rows):
            continue
        nm = t.strings("name")
        groups[g].append({"dev": dev.astype(np.int64), "stream": stream.astype(np.int64),
                          "start": t["ts"][rows].astype(np.int64), "end": (t["ts"][rows] + t["dur"][rows]).astype(np.int64),
                          "name": labels.remap(nm.labels)[nm.codes[rows]],
                          "src": np.full(len(rows), SOURCES.index(s), np.int8), "row": rows.astype(np.int64)})
    cat = {g: {k: np.concatenate([p[k] for p in ps]) for k in ps[0]} for g, ps in groups.items() if ps}
    for c in cat.values():
        c["key"] = (c["dev"] << 32) + (c["stream"] & 0xFFFFFFFF)
    keys = npx.unique(np.concatenate([c["key"] for c in cat.values()])) if cat else np.zeros(0, np.int64)
    for k in keys.tolist():
        d, s = int(k >> 32), int(k & 0xFFFFFFFF)
        s = s - (1 << 32) if s >= 1 << 31 else s  # stream -1 (unknown) stays -1
        for g, kind in (("annotations", "annotations"), ("work", "kernels / memcpy"), ("sync", "sync")):
            c = cat.get(g)
            if c is None:
                continue
            idx = np.nonzero(c["key"] == k)[0]
            if not len(idx):
                continue
            ns = nest(c["start"][idx], c["end"][idx])
            o = idx[ns.order]
            for lane_d in npx.unique(ns.depth).tolist():
                oo = o[ns.depth == lane_d]
                track = f"GPU {d} stream {s}" + ("" if g == "work" else f" {kind}")
                if g == "work" and lane_d:
                    track += f" (overlap {lane_d})"
                add(Lane(len(lanes), "gpu", track, int(lane_d) if g == "annotations" else 0, c["start"][oo],
                         c["end"][oo], c["name"][oo], c["src"][oo], c["row"][oo], kind=kind, proc=d, thread=s))
    # native: one lane per traced library and thread (nested calls by depth), one per thread of syscalls
    for s, kind in (("calls", "calls"), ("syscalls", "syscalls")):
        t = rt.table(s)
        if not len(t):
            continue
        nm = t.strings("name")
        codes = labels.remap(nm.labels)[nm.codes]
        lib = t.strings("lib").values() if s == "calls" else np.full(len(t), "syscalls", dtype=object)
        thread = t.strings("thread").values()
        for key in sorted({(str(a), int(b)) for a, b in zip(lib.tolist(), t["tid"].tolist())}):
            idx = np.nonzero((lib == key[0]) & (t["tid"] == key[1]))[0]
            ns = nest(t["ts"][idx].astype(np.int64), (t["ts"][idx] + np.maximum(t["dur"][idx], 1)).astype(np.int64))
            o = idx[ns.order]
            tn = str(thread[idx[0]])
            for d in npx.unique(ns.depth).tolist():
                oo = o[ns.depth == d]
                m = ns.depth == d
                track = f"{key[0]}{' calls' if s == 'calls' else ''} · tid {key[1]}{' (' + tn + ')' if tn else ''}"
                add(Lane(len(lanes), "native", track, int(d), ns.start[m], ns.end[m], codes[oo],
                         np.full(len(oo), SOURCES.index(s), np.int8), oo.astype(np.int64), kind=kind,
                         thread=key[1]))
    lo = min((int(l.start[0]) for l in lanes if len(l)), default=0)
    hi = max((int(l.endmax[-1]) for l in lanes if len(l)), default=lo + 1)
    procs = {}
    if len(tree):
        procs = {lane.proc: proc_names.get(lane.proc, "") for lane in lanes if lane.group == "host"}
    tl = TimelineIndex(rt.rank, lanes, labels.list(), lo, max(hi, lo + 1), where, tree, procs)
    cache["timeline_index"] = tl
    return tl


def lanes_info(tl: TimelineIndex) -> list[dict]:
    """The lanes (without their events), in display order."""
    return [{"id": l.id, "group": l.group, "track": l.track, "depth": l.depth, "kind": l.kind, "events": len(l),
             "proc": l.proc, "thread": l.thread} for l in tl.lanes]


def window(tl: TimelineIndex, t0: int, t1: int, px: int, lane_ids: list[int] | None = None,
           max_events: int = 50_000, origin: int = 0) -> dict:
    """What to draw for ``[t0, t1)`` (absolute ns) at ``px`` pixel columns; times in the answer
    are ns after ``origin``.

    Returns ``{"bucket_ns", "lanes": [{"id", "events": {start,end,name,source,row}, "summary":
    {col,count,busy}}], "names": {code: label}, "truncated"}``; ``busy`` is the share of the
    column covered by events starting in it (capped at 1). At most ``max_events`` events in all.
    """
    px = int(min(max(px, 1), MAX_PX))
    t0, t1 = int(t0), int(max(t1, t0 + 1))
    bw = (t1 - t0) / px
    ids = range(len(tl.lanes)) if lane_ids is None else [i for i in lane_ids if 0 <= i < len(tl.lanes)]
    out, codes_seen, budget, truncated = [], [], max_events, False
    edges = np.floor(t0 + bw * np.arange(px + 1)).astype(np.int64)
    for i in ids:
        lane = tl.lanes[i]
        if not len(lane):
            continue
        lo = int(np.searchsorted(lane.endmax, t0, side="right"))
        hi = int(np.searchsorted(lane.start, t1, side="left"))
        if hi <= lo:
            continue
        entry: dict = {"id": lane.id}
        if hi - lo <= max(FULL_DETAIL_MIN, px // 4):
            sel = np.arange(lo, hi)
        else:
            # events >= 1 px wide, from the duration level just below the pixel width
            k = int(np.searchsorted(LEVEL_NS, bw, side="right")) - 1
            if k < 0:
                sel = np.arange(lo, hi)
            else:
                lev = lane.levels[min(k, len(lane.levels) - 1)] if lane.levels else np.zeros(0, np.int64)
                a, b = np.searchsorted(lev, [lo, hi])
                sel = lev[a:b]
                sel = sel[(lane.end[sel] - lane.start[sel]) >= bw]
            # per-column summary of everything else, from binary searches and prefix sums
            pos = np.searchsorted(lane.start, edges, side="left")
            cnt = np.diff(pos)
            cov = (lane.cum[pos[1:]] - lane.cum[pos[:-1]]) / bw
            nz = np.nonzero(cnt)[0]
            entry["summary"] = {"col": nz.tolist(), "count": cnt[nz].tolist(),
                                "busy": np.round(np.minimum(cov[nz], 1.0), 3).tolist()}
        if len(sel) > budget:
            sel, truncated = sel[:budget], True
        budget -= len(sel)
        entry["events"] = {"start": (lane.start[sel] - origin).tolist(), "end": (lane.end[sel] - origin).tolist(),
                           "name": lane.name[sel].tolist(), "source": lane.source[sel].tolist(),
                           "row": lane.row[sel].tolist()}
        codes_seen.append(lane.name[sel])
        out.append(entry)
    codes = npx.unique(np.concatenate(codes_seen)) if codes_seen else np.zeros(0, np.int32)
    return {"t0": t0 - origin, "t1": t1 - origin, "px": px, "bucket_ns": bw, "lanes": out,
            "names": {int(c): tl.labels[c] for c in codes.tolist()}, "truncated": truncated}


def search(tl: TimelineIndex, query: str, limit: int = 100) -> dict:
    """Events whose name contains ``query`` (case-insensitive), earliest first."""
    q = query.lower()
    codes = np.array([i for i, s in enumerate(tl.labels) if q in s.lower()], dtype=np.int32)
    hits: list[tuple[int, int, np.ndarray]] = []
    total = 0
    if len(codes):
        for lane in tl.lanes:
            m = np.nonzero(np.isin(lane.name, codes))[0]
            total += len(m)
            if len(m):
                hits.append((lane.id, len(m), m[:limit]))
    rows = []
    for lid, _, pos in hits:
        lane = tl.lanes[lid]
        for p in pos.tolist():
            rows.append({"lane": lid, "start": int(lane.start[p]), "end": int(lane.end[p]),
                         "name": tl.labels[lane.name[p]], "source": SOURCES[lane.source[p]], "row": int(lane.row[p])})
    rows.sort(key=lambda r: r["start"])
    return {"query": query, "total": total, "events": rows[:limit]}


def _row_dict(rt: RankTrace, source: str, row: int) -> dict:
    t = rt.table(source)
    out = {}
    for k, col in t.columns.items():
        v = col.labels[col.codes[row]] if hasattr(col, "labels") and col.codes[row] < len(col.labels) else (
            "" if hasattr(col, "labels") else col[row])
        out[k] = v.item() if isinstance(v, np.generic) else v
    return out


def _ref(tl: TimelineIndex, source: str, row: int) -> dict | None:
    lid, pos = tl.locate(source, row)
    if lid < 0:
        return None
    lane = tl.lanes[lid]
    return {"lane": lid, "source": source, "row": row, "name": tl.labels[lane.name[pos]],
            "start": int(lane.start[pos]), "end": int(lane.end[pos])}


def event_detail(rt: RankTrace, tl: TimelineIndex, source: str, row: int) -> dict:
    """One event's table row plus its links: launch call, launching op and Python stack of GPU
    work; GPU work launched by a runtime call; the call stack of a host event."""
    if source not in SOURCES:
        raise KeyError(source)
    if source == "steps":
        st = find_steps(rt)
        if not 0 <= row < len(st):
            raise IndexError(row)
        return {"ref": _ref(tl, source, row), "args": {"step": int(st.number[row]), "start_ns": int(st.start[row]),
                                                        "end_ns": int(st.end[row])}}
    t = rt.table(source)
    if not 0 <= row < len(t):
        raise IndexError(row)
    out: dict = {"ref": _ref(tl, source, row), "args": _row_dict(rt, source, row)}
    tree = tl.tree if tl.tree is not None else host_tree(rt)
    node = -1
    if source in ("kernels", "memops", "gpu_sync"):
        lr = int(launch_rows(rt.runtime, t.take(np.array([row])))[0])
        if lr >= 0:
            out["launch"] = _ref(tl, "runtime", lr)
            node = int(tree.runtime_node[lr]) if len(tree) else -1
            if node >= 0:
                op = int(tree.nearest(np.array([node]), OP)[0])
                if op >= 0:
                    out["op"] = _ref(tl, "ops", int(tree.row[op]))
    elif source == "annotations" and bool(t["gpu"][row]):
        pass  # a GPU-side annotation: no host call tree node
    elif source in ("calls", "syscalls"):
        pass  # the native sidecar's rows: their table row (arguments, path) is the detail
    elif len(tree):
        kind = {"python": PYTHON, "ops": OP, "runtime": RUNTIME, "annotations": ANNOTATION}[source]
        hit = np.nonzero((tree.kind == kind) & (tree.row == row))[0]
        node = int(hit[0]) if len(hit) else -1
        if source == "runtime" and "corr" in t.columns:
            corr = int(t["corr"][row])
            launched = []
            for g in ("kernels", "memops", "gpu_sync"):
                gt = rt.table(g)
                if len(gt) and "corr" in gt.columns:
                    for r in np.nonzero(gt["corr"] == corr)[0][:20].tolist():
                        if int(launch_rows(rt.runtime, gt.take(np.array([r])))[0]) == row:
                            ref = _ref(tl, g, r)
                            if ref:
                                launched.append(ref)
            out["launched"] = launched
    if node >= 0:
        out["stack"] = [{"kind": ("python", "op", "runtime", "annotation")[tree.kind[n]], "name": tree.name(n)}
                        for n in reversed(tree.ancestors(node))]
    return out


def find_at(tl: TimelineIndex, group: str, start: int, end: int | None = None) -> dict | None:
    """The event of a ``group`` lane ("gpu" or "host") that starts at ``start`` (absolute ns; and
    ends at ``end`` when given): one binary search per lane. None when there is none."""
    for lane in tl.lanes:
        if lane.group != group or not len(lane):
            continue
        i = int(np.searchsorted(lane.start, start, side="left"))
        while i < len(lane) and lane.start[i] == start:
            if end is None or lane.end[i] == end:
                return {"lane": lane.id, "source": SOURCES[lane.source[i]], "row": int(lane.row[i]),
                        "name": tl.labels[lane.name[i]], "start": int(lane.start[i]), "end": int(lane.end[i])}
            i += 1
    return None


def flows(rt: RankTrace, tl: TimelineIndex, t0: int, t1: int, limit: int = 2000, origin: int = 0) -> dict:
    """Launch -> GPU work arrows for every kernel, memcpy, memset and sync event overlapping
    ``[t0, t1)`` (absolute ns) whose launch call is in the trace, earliest first, at most ``limit``.
    Returns columns ``from_lane, from_start, from_end, to_lane, to_start, to_end`` (ns after
    ``origin``), ``total`` (arrows in the range) and ``truncated``."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("from_lane", "from_start", "from_end", "to_lane",
                                                         "to_start", "to_end")}
    rl, rp = tl.where.get("runtime", (np.zeros(0, np.int32), np.zeros(0, np.int64)))
    for lane in tl.lanes:
        if lane.group != "gpu" or lane.kind == "annotations" or not len(lane):
            continue
        lo = int(np.searchsorted(lane.endmax, t0, side="right"))
        hi = int(np.searchsorted(lane.start, t1, side="left"))
        if hi <= lo:
            continue
        pos = np.arange(lo, hi)
        pos = pos[lane.end[pos] > t0]
        for src in ("kernels", "memops", "gpu_sync"):
            p = pos[lane.source[pos] == SOURCES.index(src)]
            if not len(p):
                continue
            launch = launch_rows(rt.runtime, rt.table(src).take(lane.row[p]))
            ok = launch >= 0
            ok[ok] = rl[launch[ok]] >= 0  # the launch call is on the timeline
            p, launch = p[ok], launch[ok]
            if not len(p):
                continue
            fl = rl[launch].astype(np.int64)
            fp = rp[launch]
            cols["from_lane"].append(fl)
            cols["from_start"].append(np.array([tl.lanes[a].start[b] for a, b in zip(fl.tolist(), fp.tolist())], np.int64))
            cols["from_end"].append(np.array([tl.lanes[a].end[b] for a, b in zip(fl.tolist(), fp.tolist())], np.int64))
            cols["to_lane"].append(np.full(len(p), lane.id, np.int64))
            cols["to_start"].append(lane.start[p])
            cols["to_end"].append(lane.end[p])
    if not cols["to_lane"]:
        return {**{k: [] for k in cols}, "total": 0, "truncated": False}
    c = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.argsort(c["to_start"], kind="stable")
    total = len(order)
    order = order[:max(0, limit)]
    out = {k: (v[order] - (origin if k.endswith(("start", "end")) else 0)).tolist() for k, v in c.items()}
    return {**out, "total": int(total), "truncated": total > len(order)}


def next_occurrence(tl: TimelineIndex, source: str, row: int, direction: int) -> dict | None:
    """The next (``direction`` > 0) or previous event with the same name as the given one, in any
    lane of the rank, ordered by (start, lane, position); for a step, the next or previous step.
    None when there is none (or the event is not on the timeline)."""
    lid, pos = tl.locate(source, row)
    if lid < 0:
        return None
    lane = tl.lanes[lid]
    if lane.group == "steps":
        q = pos + (1 if direction > 0 else -1)
        return _ref_at(tl, lid, q) if 0 <= q < len(lane) else None
    code, t = lane.name[pos], int(lane.start[pos])
    best: tuple | None = None
    for ln in tl.lanes:
        idx = np.nonzero(ln.name == code)[0]
        if not len(idx):
            continue
        st = ln.start[idx]
        if direction > 0:
            if ln.id == lid:
                cand = idx[idx > pos]
            else:
                cand = idx[(st > t) | ((st == t) & (ln.id > lid))]
            if len(cand):
                key = (int(ln.start[cand[0]]), ln.id, int(cand[0]))
                best = key if best is None or key < best else best
        else:
            if ln.id == lid:
                cand = idx[idx < pos]
            else:
                cand = idx[(st < t) | ((st == t) & (ln.id < lid))]
            if len(cand):
                key = (int(ln.start[cand[-1]]), ln.id, int(cand[-1]))
                best = key if best is None or key > best else best
    return None if best is None else _ref_at(tl, best[1], best[2])


def _ref_at(tl: TimelineIndex, lid: int, pos: int) -> dict:
    lane = tl.lanes[lid]
    return {"lane": lid, "source": SOURCES[lane.source[pos]], "row": int(lane.row[pos]),
            "name": tl.labels[lane.name[pos]], "start": int(lane.start[pos]), "end": int(lane.end[pos])}
