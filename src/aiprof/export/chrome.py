"""Chrome trace-event JSON of a capture (chrome://tracing, Perfetto's JSON importer, other tools).

Same tracks as the Perfetto export (:mod:`aiprof.export.timeline`): ranks are processes
(``pid`` = rank), each host thread and GPU stream a thread row, counters as ``"C"`` events.
Timestamps are µs with ns precision (three decimals). Written in chunks, encoded by msgspec.

The events speak Kineto's dialect, as torch.profiler's own export does, so the file reads back
into ``aiprof analyze``: the categories (``cpu_op``, ``python_function``, ``cuda_runtime``,
``kernel``, ``gpu_memcpy``, ...) and the args that link them (``External id``, ``correlation``,
``device``, ``stream``, ``Python id``/``parent id``, input shapes, collective args). Flow events
draw the arrows: ``ac2g`` from each CUDA launch to the GPU work it launched (torch.profiler's
own name), ``collective`` from rank to rank through each collective matched across ranks, in
arrival order (the last arrow ends at the rank everyone waited for). A single-rank export
carries the trace's ``distributedInfo`` and ``deviceProperties``; several ranks in one file
cannot be read back as ranks (one Kineto file is one rank): export them one ``--rank`` at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Any, Callable, Optional

import msgspec
import numpy as np

from aiprof import __version__
from aiprof.export.files import atomic_open
from aiprof.export.timeline import Mark, Timeline, build_timeline
from aiprof.trace.store import Capture, RankTrace

_CHUNK = 200_000
_ENC = msgspec.json.Encoder()
# Kineto categories by timeline source; runtime and memops depend on the row (driver, kind).
_CAT = {"python": "python_function", "annotations": "user_annotation", "ops": "cpu_op", "kernels": "kernel",
        "gpu_annotations": "gpu_user_annotation"}
LAUNCH_FLOW = "ac2g"  # torch.profiler's category and name for launch → GPU work
COLLECTIVE_FLOW = "collective"
# Collective flow ids live apart from launch ids (rank + 1) << 40 | correlation: Perfetto keys a
# v1 flow by (cat, name, id), so the two never meet, but a reader keying on id alone stays safe.
_COLLECTIVE_ID_BASE = 1 << 52
# The timeline clips host slices that poke out of their parent so every row nests. Clock rounding
# between sources is sub-µs and stays clipped; a slice cut by more keeps its recorded times, as in
# torch.profiler's own JSON: ProfilerStep#N begins in one Python frame and ends in another, and the
# analysis reads step times and the training thread from it (a clipped or moved step is wrong).
CLIP_KEEP_NS = 1000


@dataclass
class ChromeStats:
    events: int  # every event written, metadata and flow events included
    flows: int  # flow arrows (pairs of "s" and "f")


def _get(t: Any, col: str) -> Optional[list]:
    return t[col].tolist() if col in t else None


def _texts(t: Any, col: str) -> Optional[list]:
    return t.strings(col).values().tolist() if col in t else None


class _Args:
    """Per (rank, source) lookups from a slice's source row to its Kineto args and category."""

    def __init__(self, capture: Capture) -> None:
        self.ranks = {rt.rank: rt for rt in capture.ranks}
        self.cache: dict[tuple[int, str], Callable[[int], tuple[str, dict]]] = {}

    def __call__(self, rank: int, source: str, row: int) -> tuple[str, Optional[dict]]:
        key = (rank, source)
        fn = self.cache.get(key)
        if fn is None:
            fn = self.cache[key] = self._make(self.ranks[rank], source)
        return fn(row)

    def _make(self, rt: RankTrace, source: str) -> Callable[[int], tuple[str, Optional[dict]]]:
        table = "annotations" if source == "gpu_annotations" else source
        t = rt.table(table)
        coll = _collective_args(rt)
        if source == "python":
            ids, parent, module = _get(t, "py_id"), _get(t, "parent_id"), _get(t, "module_id")
            return lambda i: ("python_function", {"Python id": ids[i], "Python parent id": parent[i],
                                                  "Python module id": module[i]})
        if source in ("annotations", "gpu_annotations"):
            ext = _get(t, "ext_id")
            cat = _CAT[source]
            return lambda i: (cat, _merge({"External id": ext[i]}, coll.get(("cpu", ext[i]))))
        if source == "ops":
            ext, seq, fwd, flops = _get(t, "ext_id"), _get(t, "seq"), _get(t, "fwd_tid"), _get(t, "flops")
            dims, types = _texts(t, "input_dims"), _texts(t, "input_types")

            def op(i: int) -> tuple[str, dict]:
                a: dict = {"External id": ext[i]}
                if seq[i] >= 0:
                    a["Sequence number"] = seq[i]
                if fwd[i] >= 0:
                    a["Fwd thread id"] = fwd[i]
                if flops[i] == flops[i] and flops[i] > 0:  # NaN: not recorded
                    a["flops"] = flops[i]
                if dims and dims[i]:
                    a["Input Dims"] = msgspec.Raw(dims[i].encode())
                if types and types[i]:
                    a["Input type"] = msgspec.Raw(types[i].encode())
                return "cpu_op", _merge(a, coll.get(("cpu", ext[i])))
            return op
        if source == "runtime":
            corr, ext, cbid, drv = _get(t, "corr"), _get(t, "ext_id"), _get(t, "cbid"), _get(t, "driver")
            return lambda i: ("cuda_driver" if drv[i] else "cuda_runtime",
                              {"correlation": corr[i], "External id": ext[i], "cbid": cbid[i]})
        if source in ("kernels", "memops"):
            dev, stream, corr, ext = _get(t, "device"), _get(t, "stream"), _get(t, "corr"), _get(t, "ext_id")
            if source == "memops":
                nbytes, kind = _get(t, "bytes"), _texts(t, "kind")
                return lambda i: ("gpu_memset" if kind[i] == "memset" else "gpu_memcpy",
                                  {"device": dev[i], "stream": stream[i], "correlation": corr[i],
                                   "External id": ext[i], "bytes": nbytes[i]})
            g = [_get(t, f"grid_{a}") for a in "xyz"]
            b = [_get(t, f"block_{a}") for a in "xyz"]
            extra = [(k, _get(t, c)) for k, c in (("registers per thread", "regs"), ("shared memory", "smem"),
                                                  ("blocks per SM", "blocks_per_sm"), ("warps per SM", "warps_per_sm"),
                                                  ("est. achieved occupancy %", "occupancy"), ("queued", "queued"))
                     if c in t]

            def kernel(i: int) -> tuple[str, dict]:
                a: dict = {"device": dev[i], "stream": stream[i], "correlation": corr[i], "External id": ext[i]}
                if g[0] is not None and g[0][i] >= 0:
                    a["grid"] = [g[0][i], g[1][i], g[2][i]]
                    a["block"] = [b[0][i], b[1][i], b[2][i]]
                for k, v in extra:
                    if v[i] == v[i] and v[i] >= 0:  # NaN or -1: not recorded
                        a[k] = v[i]
                return "kernel", _merge(a, coll.get(("gpu", corr[i])))
            return kernel
        return lambda i: (source, None)  # steps, marks, calls, syscalls: aiprof's own rows


def _merge(a: dict, b: Optional[dict]) -> dict:
    return a if not b else {**a, **b}


def _collective_args(rt: RankTrace) -> dict[tuple[str, int], dict]:
    """Kineto's collective args of the rank, keyed by ("gpu", correlation) for NCCL kernels and
    ("cpu", External id) for the host ops and annotations that carry them."""
    c = rt.collectives
    if not len(c):
        return {}
    side, coll = c.strings("side").values().tolist(), c.strings("coll").values().tolist()
    pg, desc, ranks = (c.strings(k).values().tolist() for k in ("pg_name", "pg_desc", "pg_ranks"))
    dtype = c.strings("dtype").values().tolist()
    size, inn, out, seq, ext, corr = (c[k].tolist() for k in ("group_size", "in_nelems", "out_nelems", "seq",
                                                              "ext_id", "corr"))
    found: dict[tuple[str, int], dict] = {}
    for i in range(len(c)):
        key = ("gpu", corr[i]) if side[i] == "gpu" else ("cpu", ext[i])
        if key[1] < 0:
            continue
        a: dict = {"Collective name": coll[i], "In msg nelems": inn[i], "Out msg nelems": out[i],
                   "Group size": size[i], "dtype": dtype[i], "Process Group Name": pg[i],
                   "Process Group Description": desc[i], "Seq": seq[i]}
        if ranks[i]:
            a["Process Group Ranks"] = msgspec.Raw(ranks[i].encode())
        found[key] = a
    return found


def _header(capture: Capture) -> dict:
    """Top-level keys: a single rank's Kineto metadata (so it reads back as that rank), and what
    wrote the file."""
    head: dict = {"displayTimeUnit": "ns",
                  "aiprof": {"exported_by": f"aiprof {__version__}", "ranks": [rt.rank for rt in capture.ranks]}}
    if len(capture.ranks) == 1:
        rt = capture.ranks[0]
        m = rt.meta
        dist = dict(m.get("distributed") or {})
        dist.setdefault("rank", rt.rank)
        dist.setdefault("world_size", m.get("world_size") or 1)
        head["distributedInfo"] = dist
        if m.get("device_properties"):
            head["deviceProperties"] = m["device_properties"]
        if m.get("host_name"):
            head["host_name"] = m["host_name"]
        head.update(m.get("versions") or {})
        head.update(m.get("options") or {})
    return head


def _collective_flows(capture: Capture, tl: Timeline, tid_of: dict[int, int], rank_of: dict[int, int]) -> list[dict]:
    """Flow events through each collective matched across ranks, in arrival order."""
    if len(capture.ranks) < 2:
        return []
    from aiprof.analysis.ranks import matched_collectives

    mc = matched_collectives(capture, {})
    if not mc.local_start.size:
        return []
    # the exported slice each collective start falls on: kernels (NCCL) or host ops
    at: dict[tuple[int, int], int] = {}
    for s, trk, src in zip(tl.start.tolist(), tl.track.tolist(), tl.source.tolist()):
        if tl.sources[src] in ("kernels", "ops", "annotations"):
            at.setdefault((rank_of[trk], s), trk)
    evs = []
    for j in range(mc.local_start.shape[1]):
        hops = []
        for i, r in enumerate(mc.ranks):
            s = int(mc.local_start[i, j])
            trk = at.get((r, s)) if s >= 0 else None
            if trk is not None:
                aligned = mc.start[i, j]
                hops.append((aligned if aligned == aligned else float(s), r, s, trk))
        hops.sort()
        for k in range(len(hops) - 1):
            fid = _COLLECTIVE_ID_BASE + j * len(mc.ranks) + k
            for ph, (_, r, s, trk) in (("s", hops[k]), ("f", hops[k + 1])):
                ev = {"ph": ph, "id": fid, "cat": COLLECTIVE_FLOW, "name": COLLECTIVE_FLOW, "pid": r,
                      "tid": tid_of[trk], "ts": s / 1000.0}
                if ph == "f":
                    ev["bp"] = "e"
                evs.append(ev)
    return evs


def _memory_events(rt: RankTrace, rows_of: dict[tuple[int, int, int], int]) -> list[dict]:
    """The allocator's ``[memory]`` instants, as Kineto writes them, on the row of the thread that
    allocated (``rows_of``: (rank, pid, tid) -> row): the report attributes them to its ops."""
    m = rt.memory
    if not len(m):
        return []
    row = [rows_of.get((rt.rank, p, t), 0) for p, t in zip(m["pid"].tolist(), m["tid"].tolist())]
    cols = [m[k].tolist() for k in ("ts", "addr", "bytes", "total_allocated", "total_reserved", "device_id",
                                    "device_type")]
    return [{"ph": "i", "s": "t", "name": "[memory]", "cat": "cpu_instant_event", "pid": rt.rank, "tid": tid,
             "ts": ts / 1000.0, "args": {"Addr": a, "Bytes": b, "Total Allocated": ta, "Total Reserved": tr,
                                         "Device Id": d, "Device Type": dt}}
            for tid, (ts, a, b, ta, tr, d, dt) in zip(row, zip(*cols))]


def _recorded_times(capture: Capture, tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Each slice's start and end: as recorded where nesting cut it by more than CLIP_KEEP_NS."""
    start, end = tl.start.copy(), tl.end.copy()
    rank = np.array([t.rank for t in tl.tracks] + [0], np.int64)
    pos = {t.uuid: i for i, t in enumerate(tl.tracks)}
    track_rank = rank[np.array([pos[u] for u in tl.track.tolist()], np.int64)] if len(tl.track) else tl.track
    for rt in capture.ranks:
        for src in ("python", "annotations", "ops", "runtime"):
            m = (track_rank == rt.rank) & (tl.source == tl.sources.index(src)) & (tl.row >= 0)
            if m.any():
                t = rt.table(src)
                rows = tl.row[m]
                start[m], end[m] = t["ts"][rows], t["ts"][rows] + t["dur"][rows]
    cut = (np.abs(start - tl.start) > CLIP_KEEP_NS) | (np.abs(end - tl.end) > CLIP_KEEP_NS)
    return np.where(cut, start, tl.start), np.where(cut, end, tl.end)


def write(tl: Timeline, f: IO[bytes], capture: Optional[Capture] = None) -> ChromeStats:
    """Write ``tl`` as Chrome JSON (with ``capture``: Kineto args, header and collective flows)."""
    head = _header(capture) if capture is not None else {"displayTimeUnit": "ns"}
    f.write(_ENC.encode(head)[:-1] + b',"traceEvents":[\n')
    meta = []
    tid_of = {}
    for i, t in enumerate(tl.tracks):
        tid_of[t.uuid] = i + 1
        meta.append({"ph": "M", "name": "thread_name", "pid": t.rank, "tid": i + 1, "args": {"name": t.name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": t.rank, "tid": i + 1, "args": {"sort_index": i}})
    for r in tl.meta.get("ranks", []):
        host = f" · {r['host']}" if r.get("host") else ""
        meta.append({"ph": "M", "name": "process_name", "pid": r["rank"], "args": {"name": f"rank {r['rank']}{host}"}})
    rank_of = {t.uuid: t.rank for t in tl.tracks}
    args_of = _Args(capture) if capture is not None else None
    start, end = (tl.start, tl.end) if capture is None else _recorded_times(capture, tl)
    first = True
    count = 0
    flows = 0

    def emit(events: list) -> None:
        nonlocal first, count
        if not events:
            return
        body = _ENC.encode(events)[1:-1]
        f.write((b"" if first else b",\n") + body)
        first = False
        count += len(events)

    emit(meta)
    names = tl.names
    # an arrow needs both ends: with --no-host the launches are not exported, so no "f" alone
    fin = np.where(np.isin(tl.flow_in, tl.flow_out[tl.flow_out > 0]), tl.flow_in, 0)
    order = np.lexsort((tl.depth, tl.start))
    sources = tl.sources
    for lo in range(0, len(order), _CHUNK):
        o = order[lo:lo + _CHUNK]
        evs = []
        for s, e, trk, nm, src, fo, fi, row in zip(start[o].tolist(), end[o].tolist(), tl.track[o].tolist(),
                                                   tl.name[o].tolist(), tl.source[o].tolist(), tl.flow_out[o].tolist(),
                                                   fin[o].tolist(), tl.row[o].tolist()):
            pid, tid, ts = rank_of[trk], tid_of[trk], s / 1000.0
            cat, args = sources[src], None
            if args_of is not None and row >= 0:
                cat, args = args_of(pid, cat, row)
            ev = {"ph": "X", "name": names[nm], "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": (e - s) / 1000.0}
            if args:
                ev["args"] = args
            evs.append(ev)
            # launch → GPU work: "s" inside the launching call, "f" bound to the enclosing GPU slice
            if fo:
                evs.append({"ph": "s", "id": fo, "cat": LAUNCH_FLOW, "name": LAUNCH_FLOW, "pid": pid, "tid": tid,
                            "ts": ts})
            if fi:
                evs.append({"ph": "f", "id": fi, "cat": LAUNCH_FLOW, "name": LAUNCH_FLOW, "pid": pid, "tid": tid,
                            "ts": ts, "bp": "e"})
                flows += 1
        emit(evs)
    if capture is not None:
        rows_of = {(t.rank, *t.thread): tid_of[t.uuid] for t in tl.tracks if t.thread is not None}
        for rt in capture.ranks:
            emit(_memory_events(rt, rows_of))
        cf = _collective_flows(capture, tl, tid_of, rank_of)
        flows += len(cf) // 2
        emit(cf)
    for c in tl.counters:
        for lo in range(0, len(c.ts), _CHUNK):
            emit([{"ph": "C", "name": c.name, "pid": c.rank, "ts": t / 1000.0, "args": {"value": v}}
                  for t, v in zip(c.ts[lo:lo + _CHUNK].tolist(), c.value[lo:lo + _CHUNK].tolist())])
    f.write(b"\n]}\n")
    return ChromeStats(count, flows)


def export(capture: Capture, path: str, marks: Optional[list[Mark]] = None, host: bool = True) -> ChromeStats:
    """Export ``capture`` to ``path`` as Chrome JSON (``.gz`` suffix: gzip-compressed)."""
    tl = build_timeline(capture, marks=marks, host=host)
    with atomic_open(path, "wb") as raw:
        if path.endswith(".gz"):
            import gzip

            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=5) as gz:
                return write(tl, gz, capture)
        return write(tl, raw, capture)
