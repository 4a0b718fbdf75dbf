"""Turns decoded Kineto events into the store's tables (docs/metrics.md, "Tables")."""
from __future__ import annotations

from typing import Callable, Optional

import msgspec
import numpy as np

from aiprof import npx
from aiprof.trace import classify
from aiprof.trace.columns import Columns
from aiprof.trace.events import (
    CollArgs,
    Ev,
    EventError,
    KernelArgs,
    MemopArgs,
    MemoryArgs,
    MetaArgs,
    OpArgs,
    PyArgs,
    RuntimeArgs,
    SyncArgs,
    decode_args,
)
from aiprof.trace.hwcsv import hw_table
from aiprof.trace.nativecsv import calls_table, syscalls_table
from aiprof.trace.table import Table

# Times become int64 ns. A ts in [-2^60, 2^62] ns (2^62 ns: the year 2116 on a Unix-epoch clock)
# and a dur up to 2^61 ns (73 years) keep every ts - anchor and ts + dur inside int64.
TS_MIN_US = -(2.0**60) / 1000.0
TS_MAX_US = 2.0**62 / 1000.0
DUR_MAX_US = 2.0**61 / 1000.0


def _checked(evs: list[Ev], field: str, lo: float, hi: float) -> np.ndarray:
    """The events' ``field`` as float64; EventError for the first one missing or out of range."""
    a = np.array([e.ts for e in evs] if field == "ts" else [e.dur for e in evs], dtype=np.float64)
    bad = ~((a >= lo) & (a <= hi))  # NaN (missing) fails both
    if bad.any():
        i = int(np.argmax(bad))
        v = float(a[i])
        problem = (f'"{field}" is missing' if np.isnan(v) else
                   f'"{field}" is {v:g}, outside [{lo:g}, {hi:g}] µs')
        raise EventError(i, field, problem, evs[i])
    return a


def _opt(values, default):
    return [default if v is None else v for v in values]


def _kernel_cls(cache: dict, name: str, has_coll: bool) -> str:
    """Kernel class, computed once per distinct (name, has-collective-args)."""
    key = (name, has_coll)
    cls = cache.get(key)
    if cls is None:
        cls = cache[key] = classify.kernel_class(name, has_coll)
    return cls


def _pid(v) -> int:
    """Numeric pid/tid; Kineto uses strings for a few synthetic rows ("Spans", "Traces")."""
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


class Builder:
    """Turns decoded events into the store's tables, chunk by chunk."""

    def __init__(self) -> None:
        self.t: dict[str, Columns] = {}
        self.ts0: Optional[float] = None  # integer-µs anchor that keeps ns conversion exact
        self.threads: dict[tuple[int, int], dict] = {}
        self.flow_pts: list[tuple] = []
        self.kernel_cls: dict[tuple[str, bool], str] = {}
        self.agent_threads: list[int] = []
        self.n_events = 0
        self.negative_durations = 0  # clamped to 0 (see _dur_ns)

    def _ns(self, evs: list[Ev]) -> np.ndarray:
        """The events' ``ts`` in integer ns (EventError when one is missing or out of range)."""
        a = _checked(evs, "ts", TS_MIN_US, TS_MAX_US)
        if self.ts0 is None:
            self.ts0 = float(np.floor(a.min())) if len(a) else 0.0
        return np.rint((a - self.ts0) * 1000.0).astype(np.int64) + int(self.ts0) * 1000

    def _dur_ns(self, evs: list[Ev], count: bool = True) -> np.ndarray:
        """The events' ``dur`` in integer ns; a negative one (a broken exporter) counts as 0."""
        a = _checked(evs, "dur", -DUR_MAX_US, DUR_MAX_US)
        neg = a < 0
        if neg.any():
            self.negative_durations += int(neg.sum()) if count else 0
            a = np.maximum(a, 0.0)
        return np.rint(a * 1000.0).astype(np.int64)

    def _common(self, c: Columns, evs: list[Ev], host: bool) -> None:
        c.add_num("ts", self._ns(evs), np.int64)
        c.add_num("dur", self._dur_ns(evs), np.int64)
        c.add_str("name", [e.name for e in evs])
        if host:
            c.add_num("pid", [e.pid if type(e.pid) is int else _pid(e.pid) for e in evs], np.int64)
            c.add_num("tid", [e.tid if type(e.tid) is int else _pid(e.tid) for e in evs], np.int64)
        c.rows += len(evs)

    def _cols(self, table: str) -> Columns:
        c = self.t.get(table)
        if c is None:
            c = self.t[table] = Columns()
        return c

    def add(self, evs: list[Ev]) -> None:
        """Add decoded events; EventError (index counted from this builder's first event) on a bad one."""
        base = self.n_events
        self.n_events += len(evs)
        try:
            self._add(evs)
        except EventError as err:
            pos = next((i for i, e in enumerate(evs) if e is err.event), None)
            err.index = base + (pos if pos is not None else 0)
            raise

    def _add(self, evs: list[Ev]) -> None:
        buckets: dict[str, list[Ev]] = {}
        for e in evs:
            key = e.cat if e.ph == "X" else e.ph
            b = buckets.get(key)
            if b is None:
                b = buckets[key] = []
            b.append(e)
        for key, group in buckets.items():
            handler = _HANDLERS.get(key)
            if handler is not None:
                handler(self, group)

    # --- one handler per event kind ---
    def ops(self, evs: list[Ev]) -> None:
        c = self._cols("ops")
        self._common(c, evs, host=True)
        a = decode_args(evs, OpArgs)
        c.add_num("ext_id", [x.ext_id for x in a], np.int64)
        c.add_num("seq", _opt([x.seq for x in a], -1), np.int64)
        c.add_num("fwd_tid", _opt([x.fwd_tid for x in a], -1), np.int64)
        c.add_num("flops", [np.nan if x.flops is None else x.flops for x in a], np.float64)
        c.add_str("input_dims", [bytes(x.dims or x.dims_old).decode() for x in a])
        c.add_str("input_types", [bytes(x.types).decode() for x in a])
        self._collectives(evs, a, side="cpu")

    def annotations(self, evs: list[Ev], gpu: bool = False) -> None:
        c = self._cols("annotations")
        self._common(c, evs, host=True)
        a = decode_args(evs, CollArgs)
        c.add_num("ext_id", [x.ext_id for x in a], np.int64)
        c.add_num("gpu", [gpu] * len(evs), np.bool_)
        self._collectives(evs, a, side="cpu")

    def gpu_annotations(self, evs: list[Ev]) -> None:
        self.annotations(evs, gpu=True)

    def python(self, evs: list[Ev]) -> None:
        c = self._cols("python")
        self._common(c, evs, host=True)
        a = decode_args(evs, PyArgs)
        c.add_num("py_id", _opt([x.py_id for x in a], -1), np.int64)
        c.add_num("parent_id", _opt([x.py_parent for x in a], -1), np.int64)
        c.add_num("module_id", _opt([x.py_module for x in a], -1), np.int64)

    def runtime(self, evs: list[Ev], driver: bool = False) -> None:
        c = self._cols("runtime")
        self._common(c, evs, host=True)
        a = decode_args(evs, RuntimeArgs)
        c.add_num("corr", [x.corr_id for x in a], np.int64)
        c.add_num("ext_id", [x.ext_id for x in a], np.int64)
        c.add_num("cbid", _opt([x.cbid for x in a], -1), np.int64)
        c.add_num("driver", [driver] * len(evs), np.bool_)

    def driver(self, evs: list[Ev]) -> None:
        self.runtime(evs, driver=True)

    def _gpu_common(self, c: Columns, evs: list[Ev], a: list) -> None:
        self._common(c, evs, host=False)
        c.add_num("device", [x.device if x.device is not None else _pid(e.pid) for x, e in zip(a, evs)], np.int64)
        c.add_num("stream", [x.stream if x.stream is not None else _pid(e.tid) for x, e in zip(a, evs)], np.int64)
        c.add_num("corr", [x.corr_id for x in a], np.int64)
        c.add_num("ext_id", [x.ext_id for x in a], np.int64)

    def kernels(self, evs: list[Ev]) -> None:
        c = self._cols("kernels")
        a = decode_args(evs, KernelArgs)
        self._gpu_common(c, evs, a)
        for i, axis in enumerate("xyz"):
            c.add_num(f"grid_{axis}", [x.grid[i] if x.grid and len(x.grid) > i else -1 for x in a], np.int64)
            c.add_num(f"block_{axis}", [x.block[i] if x.block and len(x.block) > i else -1 for x in a], np.int64)
        c.add_num("regs", _opt([x.regs for x in a], -1), np.int32)
        c.add_num("smem", _opt([x.smem for x in a], -1), np.int64)
        c.add_num("blocks_per_sm", [np.nan if x.blocks_sm is None else x.blocks_sm for x in a], np.float32)
        c.add_num("warps_per_sm", [np.nan if x.warps_sm is None else x.warps_sm for x in a], np.float32)
        c.add_num("occupancy", [np.nan if x.occupancy is None else x.occupancy for x in a], np.float32)
        c.add_num("queued", _opt([x.queued for x in a], -1), np.int64)
        cache = self.kernel_cls
        c.add_str("cls", [_kernel_cls(cache, e.name, x.coll is not None) for e, x in zip(evs, a)])
        self._collectives(evs, a, side="gpu")

    def memops(self, evs: list[Ev], kind: str) -> None:
        c = self._cols("memops")
        a = decode_args(evs, MemopArgs)
        self._gpu_common(c, evs, a)
        c.add_num("bytes", _opt([x.nbytes for x in a], -1), np.int64)
        c.add_str("kind", [kind] * len(evs))

    def memcpy(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMCPY)

    def memset(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMSET)

    def gpu_sync(self, evs: list[Ev]) -> None:
        c = self._cols("gpu_sync")
        a = decode_args(evs, SyncArgs)
        self._gpu_common(c, evs, a)
        c.add_num("wait_stream", _opt([x.wait_stream for x in a], -1), np.int64)
        c.add_num("wait_corr", _opt([x.wait_corr for x in a], -1), np.int64)

    def _collectives(self, all_evs: list[Ev], all_args: list, side: str) -> None:
        pick = [i for i, x in enumerate(all_args) if x.coll is not None]
        if not pick:
            return
        evs = [all_evs[i] for i in pick]
        a = [all_args[i] for i in pick]
        c = self._cols("collectives")
        c.add_num("ts", self._ns(evs), np.int64)
        c.add_num("dur", self._dur_ns(evs, count=False), np.int64)  # counted by _common
        c.add_str("name", [e.name for e in evs])
        c.add_str("side", [side] * len(evs))
        c.add_num("tid", [getattr(x, "stream", None) if side == "gpu" and getattr(x, "stream", None) is not None
                          else _pid(e.tid) for x, e in zip(a, evs)], np.int64)
        c.add_str("coll", [classify.canonical_collective(x.coll or "") for x in a])
        c.add_str("pg_name", [x.pg_name or "" for x in a])
        c.add_str("pg_desc", [x.pg_desc or "" for x in a])
        c.add_str("pg_ranks", [bytes(x.pg_ranks).decode() for x in a])
        c.add_str("dtype", [x.dtype or "" for x in a])
        c.add_num("group_size", _opt([x.group_size for x in a], -1), np.int64)
        c.add_num("in_nelems", [x.in_nelems if x.in_nelems is not None else (x.in_size_old if x.in_size_old is not None else -1) for x in a], np.int64)
        c.add_num("out_nelems", [x.out_nelems if x.out_nelems is not None else (x.out_size_old if x.out_size_old is not None else -1) for x in a], np.int64)
        c.add_num("seq", _opt([x.coll_seq for x in a], -1), np.int64)
        c.add_num("ext_id", [x.ext_id for x in a], np.int64)
        c.add_num("corr", [getattr(x, "corr_id", -1) for x in a], np.int64)
        c.rows += len(evs)

    def memory(self, evs: list[Ev]) -> None:
        evs = [e for e in evs if e.name == "[memory]"]
        if not evs:
            return
        c = self._cols("memory")
        c.add_num("ts", self._ns(evs), np.int64)
        c.add_num("pid", [_pid(e.pid) for e in evs], np.int64)
        c.add_num("tid", [_pid(e.tid) for e in evs], np.int64)
        a = decode_args(evs, MemoryArgs)
        c.add_num("addr", _opt([x.addr for x in a], 0), np.int64)
        c.add_num("bytes", _opt([x.mem_bytes for x in a], 0), np.int64)
        c.add_num("total_allocated", _opt([x.total_alloc for x in a], -1), np.int64)
        c.add_num("total_reserved", _opt([x.total_reserved for x in a], -1), np.int64)
        c.add_num("device_id", _opt([x.device_id for x in a], -1), np.int64)
        c.add_num("device_type", _opt([x.device_type for x in a], -1), np.int64)
        c.rows += len(evs)

    def instants(self, evs: list[Ev]) -> None:
        self.memory(evs)

    def metadata(self, evs: list[Ev]) -> None:
        evs = [e for e in evs if e.name in ("thread_name", "process_name", "process_labels")]
        for e, x in zip(evs, decode_args(evs, MetaArgs) if evs else []):
            key = (_pid(e.pid), _pid(e.tid) if e.name == "thread_name" else -1)
            self.threads.setdefault(key, {})[e.name] = str(x.label or "")

    def flow_start(self, evs: list[Ev]) -> None:
        self._flow_points(evs, 0)

    def flow_end(self, evs: list[Ev]) -> None:
        self._flow_points(evs, 1)

    def _flow_points(self, evs: list[Ev], end: int) -> None:
        # Paired in finish(): a flow's start and end may sit in different chunks.
        self.flow_pts.append((end, [(e.cat, e.id) for e in evs], self._ns(evs),
                              np.array([e.pid if type(e.pid) is int else _pid(e.pid) for e in evs], np.int64),
                              np.array([e.tid if type(e.tid) is int else _pid(e.tid) for e in evs], np.int64)))

    def _pair_flows(self):
        """Match flow starts ("s") to ends ("f") by (cat, id); None when there are no pairs."""
        def cat(end: int):
            parts = [p for p in self.flow_pts if p[0] == end]
            if not parts:
                return [], [np.zeros(0, np.int64)] * 3
            keys = [k for p in parts for k in p[1]]
            return keys, [np.concatenate([p[i] for p in parts]) for i in (2, 3, 4)]
        skeys, scols = cat(0)
        ekeys, ecols = cat(1)
        start_of = dict(zip(skeys, range(len(skeys))))  # a repeated id keeps its last start
        si = np.array([start_of.get(k, -1) for k in ekeys], dtype=np.int64)
        ok = si >= 0
        if not ok.any():
            return None
        keys = [k for k, good in zip(ekeys, ok) if good]
        return keys, [c[si[ok]] for c in scols], [c[ok] for c in ecols]

    def merge(self, other: "Builder") -> None:
        """Append the rows another builder decoded (a worker's chunk), remapping string codes."""
        for name, oc in other.t.items():
            c = self._cols(name)
            for k, parts in oc.numeric.items():
                c.numeric.setdefault(k, []).extend(parts)
            for k, (oindex, oparts) in oc.strings.items():
                index, parts = c.strings.setdefault(k, ({}, []))
                remap = np.array([index.setdefault(lab, len(index)) for lab in oindex] or [0], dtype=np.int32)
                parts.extend(remap[p] for p in oparts)
            c.rows += oc.rows
        self.flow_pts.extend(other.flow_pts)
        for key, names in other.threads.items():
            self.threads.setdefault(key, {}).update(names)
        self.n_events += other.n_events
        self.negative_durations += other.negative_durations

    def finish(self) -> dict[str, Table]:
        tables = {name: c.table() for name, c in self.t.items() if c.rows}
        if "python" in tables:
            tables["python"], self.agent_threads = drop_agent_threads(tables["python"])
        rows = self._pair_flows()
        if rows is not None:
            fl = Columns()
            keys, src, dst = rows
            fl.add_str("cat", [k[0] for k in keys])
            fl.add_num("id", [_pid(k[1]) for k in keys], np.int64)
            for i, col in enumerate(("ts", "pid", "tid")):
                fl.add_num("src_" + col, src[i], np.int64)
                fl.add_num("dst_" + col, dst[i], np.int64)
            fl.rows = len(keys)
            tables["flows"] = fl.table("src_ts")
        if self.threads:
            th = Columns()
            keys = sorted(self.threads)
            th.add_num("pid", [k[0] for k in keys], np.int64)
            th.add_num("tid", [k[1] for k in keys], np.int64)
            th.add_str("name", [self.threads[k].get("thread_name") or self.threads[k].get("process_name", "") for k in keys])
            th.add_str("labels", [self.threads[k].get("process_labels", "") for k in keys])
            th.rows = len(keys)
            tables["threads"] = th.table()
        return tables


_HANDLERS: dict[str, Callable[[Builder, list[Ev]], None]] = {
    "cpu_op": Builder.ops,
    "user_annotation": Builder.annotations,
    "gpu_user_annotation": Builder.gpu_annotations,
    "python_function": Builder.python,
    "cuda_runtime": Builder.runtime,
    "cuda_driver": Builder.driver,
    "kernel": Builder.kernels,
    "gpu_memcpy": Builder.memcpy,
    "gpu_memset": Builder.memset,
    "cuda_sync": Builder.gpu_sync,
    "i": Builder.instants,
    "M": Builder.metadata,
    "s": Builder.flow_start,
    "f": Builder.flow_end,
}

# Tables every capture has (possibly empty), in the order the docs list them.
TABLES = ("ops", "annotations", "python", "runtime", "kernels", "memops", "gpu_sync", "flows",
          "collectives", "memory", "threads", "hw", "calls", "syscalls")


def _schema() -> dict[str, Table]:
    """Every table's columns with no rows, made by the handlers themselves from one event each."""
    def ev(ph: str, cat: str = "", name: str = "x", id: int | None = None) -> Ev:
        return Ev(ph=ph, cat=cat, name=name, pid=1, tid=1, ts=0.0, dur=0.0, id=id,
                  args=msgspec.Raw(b'{"Collective name": "allreduce", "name": "x"}'))
    b = Builder()
    b.add([ev("X", cat) for cat in _HANDLERS if cat not in ("i", "M", "s", "f")]
          + [ev("i", name="[memory]"), ev("M", name="thread_name"), ev("s", "ac2g", id=1), ev("f", "ac2g", id=1)])
    tables = b.finish()
    tables["hw"] = hw_table([], [], [], [])
    tables["calls"] = calls_table([])
    tables["syscalls"] = syscalls_table([])
    missing = set(TABLES) - set(tables)
    assert not missing, f"tables without a schema: {missing}"
    return {name: t.take(np.zeros(0, np.int64)) for name, t in tables.items()}


_EMPTY: dict[str, Table] = {}


def empty_table(name: str) -> Table:
    """The named table with all its columns and no rows: what an analysis reads when a trace has
    no such events, so that every analysis runs on every subset of tables."""
    if not _EMPTY:
        _EMPTY.update(_schema())
    t = _EMPTY.get(name)
    return Table(dict(t.columns)) if t is not None else Table()


_AGENT_CODE = "aiprof/agent/"
_THREAD_ENTRY = "threading.py("


def drop_agent_threads(py: Table) -> tuple[Table, list[int]]:
    """Drop the Python frames of aiprof's own agent threads (hardware sampler, control socket).

    torch's Python tracer records every thread, so a capture made by the agent would show its
    sampler as the busiest "user" code. A thread is the agent's when an ``aiprof/agent/`` frame
    sits directly under its ``threading.py`` entry frames. Agent frames inside the user's
    threads (the optimizer-step hook) are the job's real cost and stay.
    """
    names = py.strings("name")
    is_agent = names.isin_labels(lambda s: _AGENT_CODE in s)
    if not is_agent.any():
        return py, []
    is_entry = names.isin_labels(lambda s: s.startswith(_THREAD_ENTRY))
    ids, parent = py["py_id"], py["parent_id"]
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]

    def parent_row(rows: np.ndarray) -> np.ndarray:
        pid = parent[rows]
        pos = np.minimum(np.searchsorted(sorted_ids, pid), len(sorted_ids) - 1)
        return np.where((pid >= 0) & (sorted_ids[pos] == pid), order[pos], -1)

    rows = np.nonzero(is_agent)[0]
    cur = parent_row(rows)
    # climb through threading.py frames; an agent frame whose chain ends at the root is a thread entry
    for _ in range(8):
        climb = (cur >= 0) & is_entry[np.maximum(cur, 0)]
        if not climb.any():
            break
        cur = np.where(climb, parent_row(np.maximum(cur, 0)), cur)
    agent_tids = npx.unique(py["tid"][rows[cur < 0]])
    if not len(agent_tids):
        return py, []
    return py.take(~np.isin(py["tid"], agent_tids)), agent_tids.tolist()

