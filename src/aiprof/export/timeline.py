"""The timeline that the Perfetto and Chrome exporters write: tracks and properly nested slices.

Both formats need, per track, slices that nest (a child ends before its parent). Host threads
nest by construction but clock rounding between event sources leaves a few children poking
out by a nanosecond or so: those are clipped to their parent (counted in ``clipped``). GPU
work on one stream is sequential; if two GPU events on one stream do overlap, the later one
goes to an "overlap" lane instead of being clipped, so GPU time is exported unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from aiprof import npx
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.steps import find_steps
from aiprof.analysis.nesting import nest
from aiprof.trace.store import Capture, RankTrace

HOST_SOURCES = ("python", "annotations", "ops", "runtime")


@dataclass
class Track:
    """A named timeline row of one rank; ``kind`` is host, gpu, gpu_annotation, steps, marks,
    calls (one traced library on one thread) or syscalls (one thread's blocked system calls)."""

    uuid: int
    rank: int
    name: str
    kind: str
    thread: Optional[tuple[int, int]] = None  # host tracks: the (pid, tid) of the recorded thread


@dataclass
class CounterTrack:
    uuid: int
    rank: int
    name: str
    unit: str  # "bytes" or ""
    ts: np.ndarray
    value: np.ndarray


@dataclass
class Mark:
    """An extra slice on a rank's "findings" track (a cause's or a symptom's time window)."""

    rank: int
    start: int
    end: int
    name: str


@dataclass
class Timeline:
    """Every slice of the capture in flat arrays; ``names[name[i]]`` is slice i's text."""

    tracks: list[Track]
    counters: list[CounterTrack]
    names: list[str]
    start: np.ndarray
    end: np.ndarray
    track: np.ndarray  # uuid
    name: np.ndarray
    depth: np.ndarray
    source: np.ndarray  # index into SOURCES
    flow_out: np.ndarray  # flow id leaving this slice (a launch), 0 = none
    flow_in: np.ndarray  # flow id ending here (the launched GPU work), 0 = none
    row: np.ndarray  # the slice's row in its rank's source table (python, ops, kernels, ...), -1 = none
    clipped: int = 0
    sources: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)

    def count_by_source(self) -> dict[str, int]:
        c = np.bincount(self.source, minlength=len(self.sources))
        return {s: int(c[i]) for i, s in enumerate(self.sources)}


SOURCES = ("python", "annotations", "ops", "runtime", "kernels", "memops", "gpu_annotations", "steps", "marks",
           "calls", "syscalls")


class _Builder:
    def __init__(self) -> None:
        self.tracks: list[Track] = []
        self.counters: list[CounterTrack] = []
        self.names: dict[str, int] = {}
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                                   ("start", "end", "track", "name", "depth", "source", "fout", "fin",
                                                    "row")}
        self.clipped = 0
        self.next_uuid = 1

    def uuid(self) -> int:
        self.next_uuid += 1
        return self.next_uuid

    def track(self, rank: int, name: str, kind: str) -> int:
        t = Track(self.uuid(), rank, name, kind)
        self.tracks.append(t)
        return t.uuid

    def codes(self, labels: list[str], codes: np.ndarray) -> np.ndarray:
        remap = np.array([self.names.setdefault(s, len(self.names)) for s in labels]
                         + [self.names.setdefault("", len(self.names))], dtype=np.int64)
        return remap[codes]

    def add(self, uuid: int, start, end, name, depth, source: str, fout=None, fin=None, row=None) -> None:
        n = len(start)
        p = self.parts
        p["start"].append(np.asarray(start, np.int64))
        p["end"].append(np.asarray(end, np.int64))
        p["track"].append(np.full(n, uuid, np.int64))
        p["name"].append(np.asarray(name, np.int64))
        p["depth"].append(np.asarray(depth, np.int64))
        p["source"].append(np.full(n, SOURCES.index(source), np.int64))
        p["fout"].append(np.zeros(n, np.int64) if fout is None else np.asarray(fout, np.int64))
        p["fin"].append(np.zeros(n, np.int64) if fin is None else np.asarray(fin, np.int64))
        p["row"].append(np.full(n, -1, np.int64) if row is None else np.asarray(row, np.int64))

    def host(self, rt: RankTrace, flows: dict[str, np.ndarray], process: dict) -> None:
        tables = []
        for si, src in enumerate(HOST_SOURCES):
            t = rt.table(src)
            if not len(t):
                continue
            keep = ~t["gpu"] if src == "annotations" else np.ones(len(t), bool)
            names = t.strings("name")
            tables.append((src, si, t.take(keep), self.codes(names.labels, names.codes[keep]),
                           flows.get(src, np.zeros(len(t), np.int64))[keep], np.nonzero(keep)[0]))
        if not tables:
            return
        pid = np.concatenate([t["pid"] for _, _, t, _, _, _ in tables])
        tid = np.concatenate([t["tid"] for _, _, t, _, _, _ in tables])
        start = np.concatenate([t["ts"] for _, _, t, _, _, _ in tables])
        end = start + np.concatenate([t["dur"] for _, _, t, _, _, _ in tables])
        name = np.concatenate([c for _, _, _, c, _, _ in tables])
        fout = np.concatenate([f for _, _, _, _, f, _ in tables])
        row = np.concatenate([r for _, _, _, _, _, r in tables])
        src = np.concatenate([np.full(len(t), si) for _, si, t, _, _, _ in tables])
        tnames = _thread_names(rt)
        for p, t in sorted(set(zip(pid.tolist(), tid.tolist()))):
            idx = np.nonzero((pid == p) & (tid == t))[0]
            ns = nest(start[idx], end[idx], src[idx])
            self.clipped += ns.repaired
            o = idx[ns.order]
            label = tnames.get((p, t)) or f"thread {t}"
            uuid = self.track(rt.rank, label + (f" (pid {p})" if len(process) > 1 else ""), "host")
            self.tracks[-1].thread = (p, t)
            for si, s in enumerate(HOST_SOURCES):
                m = src[o] == si
                if m.any():
                    self.add(uuid, ns.start[m], ns.end[m], name[o][m], ns.depth[m], s, fout=fout[o][m], row=row[o][m])

    def gpu(self, rt: RankTrace, flows: dict[str, np.ndarray]) -> None:
        rows = []
        for src in ("kernels", "memops"):
            t = rt.table(src)
            if len(t):
                names = t.strings("name")
                rows.append((src, t, self.codes(names.labels, names.codes), flows.get(src)))
        if not rows:
            return
        dev = np.concatenate([t["device"] for _, t, _, _ in rows])
        stream = np.concatenate([t["stream"] for _, t, _, _ in rows])
        start = np.concatenate([t["ts"] for _, t, _, _ in rows])
        end = start + np.concatenate([t["dur"] for _, t, _, _ in rows])
        name = np.concatenate([c for _, _, c, _ in rows])
        fin = np.concatenate([f for _, _, _, f in rows])
        row = np.concatenate([np.arange(len(t)) for _, t, _, _ in rows])
        src = np.concatenate([np.full(len(t), i) for i, (_, t, _, _) in enumerate(rows)])
        for d, s in sorted(set(zip(dev.tolist(), stream.tolist()))):
            idx = np.nonzero((dev == d) & (stream == s))[0]
            ns = nest(start[idx], end[idx])
            o = idx[ns.order]
            # overlapping GPU events (rare) get their own lane, never a clipped duration
            for lane in npx.unique(ns.depth).tolist():
                m = ns.depth == lane
                uuid = self.track(rt.rank, f"GPU {d} stream {s}" + (f" (overlap {lane})" if lane else ""), "gpu")
                for si, (sname, _, _, _) in enumerate(rows):
                    mm = m & (src[o] == si)
                    if mm.any():
                        self.add(uuid, start[o][mm], end[o][mm], name[o][mm], np.zeros(int(mm.sum())), sname,
                                 fin=fin[o][mm], row=row[o][mm])
        a = rt.annotations
        if len(a) and a["gpu"].any():
            g = a.take(a["gpu"])
            grow = np.nonzero(a["gpu"])[0]
            names = g.strings("name")
            code = self.codes(names.labels, names.codes)
            for p, t in sorted(set(zip(g["pid"].tolist(), g["tid"].tolist()))):
                m = (g["pid"] == p) & (g["tid"] == t)
                ns = nest(g["ts"][m], g["ts"][m] + g["dur"][m])
                self.clipped += ns.repaired
                uuid = self.track(rt.rank, f"GPU {p} stream {t} annotations", "gpu_annotation")
                self.add(uuid, ns.start, ns.end, code[m][ns.order], ns.depth, "gpu_annotations", row=grow[m][ns.order])

    def native(self, rt: RankTrace) -> None:
        """A track per traced library (and thread) of the ``calls`` table, and one per thread of
        the ``syscalls`` table (the sampled waits, named with the file they wait on)."""
        c = rt.table("calls")
        if len(c):
            lib, name = c.strings("lib").values(), c.strings("name").values()
            args = c.strings("args").values()
            labels = [_call_label(n, a) for n, a in zip(name.tolist(), args.tolist())]
            codes = np.array([self.names.setdefault(x, len(self.names)) for x in labels], dtype=np.int64)
            for key in sorted({(str(a), int(t)) for a, t in zip(lib.tolist(), c["tid"].tolist())}):
                m = (lib == key[0]) & (c["tid"] == key[1])
                ns = nest(c["ts"][m], c["ts"][m] + np.maximum(c["dur"][m], 1))
                self.clipped += ns.repaired
                uuid = self.track(rt.rank, f"{key[0]} calls · tid {key[1]}", "calls")
                self.add(uuid, ns.start, ns.end, codes[m][ns.order], ns.depth, "calls")
        sc = rt.table("syscalls")
        if len(sc):
            name, path, thread = sc.strings("name").values(), sc.strings("path").values(), sc.strings("thread").values()
            labels = [f"{n} {p}".strip() for n, p in zip(name.tolist(), path.tolist())]
            codes = np.array([self.names.setdefault(x, len(self.names)) for x in labels], dtype=np.int64)
            for t in sorted(set(sc["tid"].tolist())):
                m = sc["tid"] == t
                ns = nest(sc["ts"][m], sc["ts"][m] + np.maximum(sc["dur"][m], 1))
                self.clipped += ns.repaired
                tn = str(thread[m][0])
                uuid = self.track(rt.rank, f"syscalls · {tn + ' ' if tn else ''}tid {t}", "syscalls")
                self.add(uuid, ns.start, ns.end, codes[m][ns.order], ns.depth, "syscalls")

    def steps(self, rt: RankTrace) -> None:
        st = find_steps(rt)
        if st.source == "window" or not len(st):
            return
        uuid = self.track(rt.rank, "steps", "steps")
        labels = [f"step {n}" for n in st.number.tolist()]
        self.add(uuid, st.start, np.maximum(st.end, st.start + 1),
                 self.codes(labels, np.arange(len(labels), dtype=np.int32)), np.zeros(len(st)), "steps")

    def marks(self, rank: int, marks: list[Mark]) -> None:
        if not marks:
            return
        uuid = self.track(rank, "findings", "marks")
        s = np.array([m.start for m in marks], np.int64)
        e = np.maximum(np.array([m.end for m in marks], np.int64), s + 1)
        ns = nest(s, e)
        codes = self.codes([m.name for m in marks], np.arange(len(marks), dtype=np.int32))
        self.add(uuid, ns.start, ns.end, codes[ns.order], ns.depth, "marks")

    def memory_counters(self, rt: RankTrace) -> None:
        m = rt.memory
        if not len(m):
            return
        dt, dev = m["device_type"], m["device_id"]
        for t, d in sorted(set(zip(dt.tolist(), dev.tolist()))):
            sel = (dt == t) & (dev == d)
            where = "CPU" if t == 0 else f"GPU {d}"
            for col, label in (("total_allocated", "allocated"), ("total_reserved", "reserved")):
                ok = sel & (m[col] >= 0)
                if ok.any():
                    order = np.argsort(m["ts"][ok], kind="stable")
                    self.counters.append(CounterTrack(self.uuid(), rt.rank, f"{where} memory {label}", "bytes",
                                                      m["ts"][ok][order], m[col][ok][order].astype(np.float64)))

    def hw_counters(self, rt: RankTrace) -> None:
        """Hardware counters from a ``hw`` table when the store has one (long or wide form)."""
        h = rt.table("hw")
        if not len(h) or "ts" not in h:
            return
        ts = h["ts"].astype(np.int64)
        if "name" in h and "value" in h:
            names = h.strings("name")
            for code, label in enumerate(names.labels):
                sel = names.codes == code
                order = np.argsort(ts[sel], kind="stable")
                self.counters.append(CounterTrack(self.uuid(), rt.rank, label, "", ts[sel][order],
                                                  h["value"][sel][order].astype(np.float64)))
            return
        for col in h.names():
            v = h.columns[col]
            if col == "ts" or not isinstance(v, np.ndarray) or v.dtype.kind not in "iuf":
                continue
            ok = np.isfinite(v.astype(np.float64))
            self.counters.append(CounterTrack(self.uuid(), rt.rank, col, "", ts[ok], v[ok].astype(np.float64)))

    def pm_counters(self, rt: RankTrace) -> None:
        """GPU performance-monitor counters (the ``pm`` table): one track per device and counter,
        each sample's value held from its window's start; a last point closes the final window."""
        t = rt.table("pm")
        if not len(t):
            return
        dev, met = t.strings("device"), t.strings("metric")
        key = dev.codes.astype(np.int64) * (len(met.labels) + 1) + met.codes
        for k in np.unique(key):
            sel = key == k
            order = np.argsort(t["t0"][sel], kind="stable")
            ts = t["t0"][sel][order].astype(np.int64)
            v = t["value"][sel][order].astype(np.float64)
            ts = np.append(ts, int(t["t1"][sel][order][-1]))
            v = np.append(v, v[-1])
            label = f"{dev.labels[int(k // (len(met.labels) + 1))]} {met.labels[int(k % (len(met.labels) + 1))]}"
            self.counters.append(CounterTrack(self.uuid(), rt.rank, label, "", ts, v))

    def result(self) -> Timeline:
        p = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in self.parts.items()}
        return Timeline(self.tracks, self.counters, list(self.names), p["start"], p["end"], p["track"], p["name"],
                        p["depth"], p["source"], p["fout"], p["fin"], p["row"], self.clipped, SOURCES)


def _call_label(symbol: str, args_json: str) -> str:
    """A call's slice name: the symbol and its size/datatype where the probe recorded them."""
    import json

    try:
        a = json.loads(args_json)
    except ValueError:
        return symbol
    if not isinstance(a, dict):
        return symbol
    parts = [symbol]
    b = a.get("bytes")
    if isinstance(b, int) and b >= 0:
        parts.append(f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b} B")
    if a.get("datatype"):
        parts.append(str(a["datatype"]))
    return " ".join(parts)


def _thread_names(rt: RankTrace) -> dict[tuple[int, int], str]:
    th = rt.threads
    if not len(th):
        return {}
    return {(int(p), int(t)): str(n) for p, t, n in zip(th["pid"], th["tid"], th["name"]) if t >= 0}


def _flows(rt: RankTrace) -> dict[str, np.ndarray]:
    """Flow ids (launch -> GPU work) by correlation id, unique across ranks."""
    out: dict[str, np.ndarray] = {}
    r = rt.runtime
    fout = np.zeros(len(r), np.int64)
    base = (rt.rank + 1) << 40
    for src in ("kernels", "memops"):
        g = rt.table(src)
        if not len(g):
            continue
        lr = launch_rows(r, g)
        ok = lr >= 0
        out[src] = np.where(ok, base + g["corr"], 0)
        fout[lr[ok]] = base + g["corr"][ok]
    out["runtime"] = fout
    return out


def build_timeline(capture: Capture, marks: Optional[list[Mark]] = None, host: bool = True) -> Timeline:
    """All slices and counters of a capture, one group of tracks per rank."""
    b = _Builder()
    for rt in capture.ranks:
        flows = _flows(rt)
        process = {int(p) for p in (rt.ops["pid"] if len(rt.ops) else [])}
        b.steps(rt)
        b.marks(rt.rank, [m for m in (marks or []) if m.rank == rt.rank])
        if host:
            b.host(rt, flows, process)
        b.gpu(rt, flows)
        b.native(rt)
        b.memory_counters(rt)
        b.hw_counters(rt)
        b.pm_counters(rt)
    tl = b.result()
    tl.meta = {"ranks": [{"rank": rt.rank, "host": rt.meta.get("host_name", ""), "source": rt.source,
                          "pids": sorted({int(p) for p in (rt.ops["pid"] if len(rt.ops) else [])})}
                         for rt in capture.ranks]}
    return tl

