"""Turns decoded Kineto events into the store's tables (docs/metrics.md, "Tables")."""
from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Callable, NamedTuple, Optional

import msgspec
import numpy as np

from aiprof import npx
from aiprof.trace import classify
from aiprof.trace.columns import Columns, Index
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
from aiprof.trace.hwcsv import hw_table, pm_table
from aiprof.trace.nativecsv import calls_table, syscalls_table
from aiprof.trace.table import Table

# Times become int64 ns. A ts in [-2^60, 2^62] ns (2^62 ns: the year 2116 on a Unix-epoch clock)
# and a dur up to 2^61 ns (73 years) keep every ts - anchor and ts + dur inside int64.
TS_MIN_US = -(2.0**60) / 1000.0
TS_MAX_US = 2.0**62 / 1000.0
DUR_MAX_US = 2.0**61 / 1000.0


def _checked(evs: list[Ev], field: str, lo: float, hi: float) -> np.ndarray:
    """The events' ``field`` as float64; EventError for the first one missing or out of range."""
    a = np.fromiter([e.ts for e in evs] if field == "ts" else [e.dur for e in evs], np.float64, len(evs))
    if not len(a) or (lo <= a.min() and a.max() <= hi):  # two reductions: the usual, all-good case
        return a
    bad = ~((a >= lo) & (a <= hi))  # NaN (missing) fails both
    if bad.any():
        i = int(np.argmax(bad))
        v = float(a[i])
        problem = (f'"{field}" is missing' if np.isnan(v) else
                   f'"{field}" is {v:g}, outside [{lo:g}, {hi:g}] µs')
        raise EventError(i, field, problem, evs[i])
    return a


def _ints(values: list, default: int, dtype=np.int64) -> np.ndarray:
    """An integer column; None (a field absent, or JSON null) becomes ``default``.

    The common case, no None, converts in one C call; otherwise None is swapped for ``default``
    by a C-level dict lookup (``{None: default}.get(v, v)``), still without a Python loop.
    """
    try:
        return np.array(values, dtype)
    except TypeError:  # None among the values (msgspec has range-checked every int)
        return np.array(list(map({None: default}.get, values, values)), dtype)


def _floats(values: list, dtype=np.float64) -> np.ndarray:
    """A float column; None (JSON null) becomes NaN. Absent fields already default to NaN."""
    try:
        return np.array(values, dtype)
    except TypeError:
        return np.array(list(map({None: np.nan}.get, values, values)), dtype)


def _ids(values: list) -> np.ndarray:
    """Numeric pids/tids: ints as they are, strings through :func:`_pid` (the rare slow path)."""
    a = np.array(values)
    if a.dtype == np.int64 and a.ndim == 1:  # all ints (a str makes a str array, none: float64)
        return a
    return np.array([v if type(v) is int else _pid(v) for v in values], np.int64)


def _either(first: list, second: list, default: int) -> np.ndarray:
    """``first``, where it is None ``second``, where both are ``default``: new and old arg names.

    When no event has the old name (``second`` all None), this is ``_ints(first)``.
    """
    if second.count(None) == len(second):
        return _ints(first, default)
    return np.array([f if f is not None else (s if s is not None else default) for f, s in zip(first, second)],
                    np.int64)


def _ext_id(a: list) -> np.ndarray:
    """``External id`` (or the old ``external id``) of decoded args; -1 where there is none."""
    return _either([x.ext for x in a], [x.ext_old for x in a], -1)


def _corr_id(a: list) -> np.ndarray:
    """``correlation`` (or the old ``correlation id``) of decoded GPU args; -1 where there is none."""
    return _either([x.corr for x in a], [x.corr_old for x in a], -1)


def _or_id(values: list, evs: list[Ev], field: str) -> np.ndarray:
    """An arg (``device``, ``stream``) that, where absent, is the event's ``pid``/``tid``."""
    try:
        return np.array(values, np.int64)
    except TypeError:  # some absent
        ids = [e.pid for e in evs] if field == "pid" else [e.tid for e in evs]
        return np.array([v if v is not None else _pid(i) for v, i in zip(values, ids)], np.int64)


def _xyz(values: list) -> list[np.ndarray]:
    """The x, y and z columns of ``[x, y, z]`` lists (``grid``, ``block``); -1 for an absent axis."""
    try:
        a = np.array(values, np.int64)
        if a.ndim == 2 and a.shape[1] == 3:  # every list has all three axes: one C call
            return list(a.T.copy())
    except (TypeError, ValueError):  # None (no such arg) or lists of other lengths
        pass
    return [np.array([v[i] if v and len(v) > i else -1 for v in values], np.int64) for i in range(3)]


_NUL = "\x00"  # never in raw JSON text: msgspec refuses an unescaped control character


def _raw_texts(raws: list) -> list[str]:
    """The JSON texts of ``msgspec.Raw`` values ("" for an absent one), decoded in one call."""
    if not raws:
        return []
    try:
        texts = b"\x00".join(raws).decode().split(_NUL)
    except UnicodeDecodeError:  # msgspec does not check UTF-8 in raw values: see below
        texts = []
    if len(texts) != len(raws):  # the error above (or a NUL after all): one by one
        # bytes that are not UTF-8 in a shape/type argument become U+FFFD: the argument is
        # descriptive, and the rest of the trace is sound
        texts = [bytes(r).decode(errors="replace") for r in raws]
    return texts


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


class FlowPoints(NamedTuple):
    """One batch's flow starts (``end`` 0) or ends (1), paired in Builder.finish."""

    end: int
    cats: np.ndarray  # int32 codes into Builder.flow_cats
    ids: Optional[np.ndarray]  # int64; None when an id is a str or absent (then ``keys`` holds them)
    keys: Optional[list[tuple]]  # (cat, id) as decoded, only where ``ids`` is None
    ns: np.ndarray
    pid: np.ndarray
    tid: np.ndarray


def _match_last(sc: np.ndarray, sid: np.ndarray, ec: np.ndarray, eid: np.ndarray) -> np.ndarray:
    """For each end (cat code ``ec``, id ``eid``), the index of the last start with the same
    (cat, id), or -1: what ``dict(zip(start keys, range(n)))`` gives, done with sorts."""
    si = np.full(len(eid), -1, np.int64)
    for c in np.unique(ec):  # a handful of flow categories
        s_rows = np.nonzero(sc == c)[0]
        if not len(s_rows):
            continue
        ids = sid[s_rows]
        order = np.argsort(ids, kind="stable")  # equal ids keep their file order: the last is the run's last
        sorted_ids = ids[order]
        last = np.append(sorted_ids[1:] != sorted_ids[:-1], True)
        uid, upos = sorted_ids[last], s_rows[order[last]]
        e_rows = np.nonzero(ec == c)[0]
        pos = np.minimum(np.searchsorted(uid, eid[e_rows]), len(uid) - 1)
        hit = uid[pos] == eid[e_rows]
        si[e_rows[hit]] = upos[pos[hit]]
    return si


class Builder:
    """Turns decoded events into the store's tables, chunk by chunk.

    The reader hands a chunk's events over in several batches (:meth:`add`, see
    kineto.DECODE_BYTES) and then calls :meth:`end_chunk`. A batch's rows are staged by event
    kind and moved into the tables at the chunk's end, kind after kind in the order the kinds
    first appear in the chunk. So row order (which decides ties in the final sort by time) and
    the order of string labels are those of building the whole chunk at once: the tables do not
    depend on how a chunk is cut into batches.
    """

    def __init__(self) -> None:
        self.t: dict[str, Columns] = {}
        self.staged: dict[str, dict[str, Columns]] = {}  # this chunk's rows: event kind -> table -> rows
        self._stage: dict[str, Columns] = {}  # the staged tables of the kind being built
        self.ts0: Optional[float] = None  # integer-µs anchor that keeps ns conversion exact
        self.threads: dict[tuple[int, int], dict] = {}
        self.flow_pts: list[FlowPoints] = []
        self.flow_cats = Index()  # flow cat -> code in FlowPoints.cats
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
            c.add_num("pid", _ids([e.pid for e in evs]), np.int64)
            c.add_num("tid", _ids([e.tid for e in evs]), np.int64)
        c.rows += len(evs)

    def _cols(self, table: str) -> Columns:
        """The staged rows of ``table`` for the event kind being built."""
        c = self._stage.get(table)
        if c is None:
            c = self._stage[table] = Columns()
        return c

    def _table(self, table: str) -> Columns:
        c = self.t.get(table)
        if c is None:
            c = self.t[table] = Columns()
        return c

    def end_chunk(self) -> None:
        """Move the staged rows into the tables (see the class doc); call after a chunk's batches."""
        for tables in self.staged.values():
            for name, c in tables.items():
                self._table(name).extend(c)
        self.staged.clear()
        self._stage = {}

    def add(self, evs: list[Ev]) -> None:
        """Add a batch of decoded events (staged until :meth:`end_chunk`); EventError (index counted
        from this builder's first event) on a bad one."""
        base = self.n_events
        self.n_events += len(evs)
        try:
            self._add(evs)
        except EventError as err:
            pos = next((i for i, e in enumerate(evs) if e is err.event), None)
            err.index = base + (pos if pos is not None else 0)
            raise

    def _add(self, evs: list[Ev]) -> None:
        buckets: defaultdict[str, list[Ev]] = defaultdict(list)  # kinds in order of first event
        for e in evs:
            buckets[e.cat if e.ph == "X" else e.ph].append(e)
        for key, group in buckets.items():
            handler = _HANDLERS.get(key)
            if handler is not None:
                self._stage = self.staged.setdefault(key, {})
                handler(self, group)

    # --- one handler per event kind ---
    def ops(self, evs: list[Ev]) -> None:
        c = self._cols("ops")
        self._common(c, evs, host=True)
        a = decode_args(evs, OpArgs)
        c.add_num("ext_id", _ext_id(a), np.int64)
        c.add_num("seq", _ints([x.seq for x in a], -1), np.int64)
        c.add_num("fwd_tid", _ints([x.fwd_tid for x in a], -1), np.int64)
        c.add_num("flops", _floats([x.flops for x in a]), np.float64)
        dims_old = [x.dims_old for x in a]
        dims = [x.dims for x in a] if not any(dims_old) else [x.dims or x.dims_old for x in a]
        c.add_str("input_dims", _raw_texts(dims))
        c.add_str("input_types", _raw_texts([x.types for x in a]))
        self._collectives(evs, a, side="cpu")

    def annotations(self, evs: list[Ev], gpu: bool = False) -> None:
        c = self._cols("annotations")
        self._common(c, evs, host=True)
        a = decode_args(evs, CollArgs)
        c.add_num("ext_id", _ext_id(a), np.int64)
        c.add_num("gpu", np.full(len(evs), gpu), np.bool_)
        self._collectives(evs, a, side="cpu")

    def gpu_annotations(self, evs: list[Ev]) -> None:
        self.annotations(evs, gpu=True)

    def python(self, evs: list[Ev]) -> None:
        c = self._cols("python")
        self._common(c, evs, host=True)
        a = decode_args(evs, PyArgs)
        c.add_num("py_id", _ints([x.py_id for x in a], -1), np.int64)
        c.add_num("parent_id", _ints([x.py_parent for x in a], -1), np.int64)
        c.add_num("module_id", _ints([x.py_module for x in a], -1), np.int64)

    def runtime(self, evs: list[Ev], driver: bool = False) -> None:
        c = self._cols("runtime")
        self._common(c, evs, host=True)
        a = decode_args(evs, RuntimeArgs)
        c.add_num("corr", _corr_id(a), np.int64)
        c.add_num("ext_id", _ext_id(a), np.int64)
        c.add_num("cbid", _ints([x.cbid for x in a], -1), np.int64)
        c.add_num("driver", np.full(len(evs), driver), np.bool_)

    def driver(self, evs: list[Ev]) -> None:
        self.runtime(evs, driver=True)

    def _gpu_common(self, c: Columns, evs: list[Ev], a: list) -> None:
        self._common(c, evs, host=False)
        c.add_num("device", _or_id([x.device for x in a], evs, "pid"), np.int64)
        c.add_num("stream", _or_id([x.stream for x in a], evs, "tid"), np.int64)
        c.add_num("corr", _corr_id(a), np.int64)
        c.add_num("ext_id", _ext_id(a), np.int64)

    def kernels(self, evs: list[Ev]) -> None:
        c = self._cols("kernels")
        a = decode_args(evs, KernelArgs)
        self._gpu_common(c, evs, a)
        grid = _xyz([x.grid for x in a])
        block = _xyz([x.block for x in a])
        for i, axis in enumerate("xyz"):
            c.add_num(f"grid_{axis}", grid[i], np.int64)
            c.add_num(f"block_{axis}", block[i], np.int64)
        c.add_num("regs", _ints([x.regs for x in a], -1, np.int32), np.int32)
        c.add_num("smem", _ints([x.smem for x in a], -1), np.int64)
        c.add_num("blocks_per_sm", _floats([x.blocks_sm for x in a], np.float32), np.float32)
        c.add_num("warps_per_sm", _floats([x.warps_sm for x in a], np.float32), np.float32)
        c.add_num("occupancy", _floats([x.occupancy for x in a], np.float32), np.float32)
        c.add_num("queued", _ints([x.queued for x in a], -1), np.int64)
        c.add_str("cls", self._kernel_classes([e.name for e in evs], [x.coll is not None for x in a]))
        self._collectives(evs, a, side="gpu")

    def _kernel_classes(self, names: list[str], has_coll: list[bool]) -> list[str]:
        """Each kernel's class, looked up by (name, has collective args) in C; classified in
        Python only for a pair not seen before (a trace has a few thousand distinct kernels)."""
        keys = list(zip(names, has_coll))
        cls = list(map(self.kernel_cls.get, keys))
        if None in cls:
            cache = self.kernel_cls
            cls = [v if v is not None else _kernel_cls(cache, *k) for v, k in zip(cls, keys)]
        return cls

    def memops(self, evs: list[Ev], kind: str) -> None:
        c = self._cols("memops")
        a = decode_args(evs, MemopArgs)
        self._gpu_common(c, evs, a)
        c.add_num("bytes", _ints([x.nbytes for x in a], -1), np.int64)
        c.add_same_str("kind", kind, len(evs))

    def memcpy(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMCPY)

    def memset(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMSET)

    def gpu_sync(self, evs: list[Ev]) -> None:
        c = self._cols("gpu_sync")
        a = decode_args(evs, SyncArgs)
        self._gpu_common(c, evs, a)
        c.add_num("wait_stream", _ints([x.wait_stream for x in a], -1), np.int64)
        c.add_num("wait_corr", _ints([x.wait_corr for x in a], -1), np.int64)

    def _collectives(self, all_evs: list[Ev], all_args: list, side: str) -> None:
        colls = [x.coll for x in all_args]
        if colls.count(None) == len(colls):  # the usual chunk: no collective among these events
            return
        pick = [i for i, x in enumerate(colls) if x is not None]
        evs = [all_evs[i] for i in pick]
        a = [all_args[i] for i in pick]
        c = self._cols("collectives")
        c.add_num("ts", self._ns(evs), np.int64)
        c.add_num("dur", self._dur_ns(evs, count=False), np.int64)  # counted by _common
        c.add_str("name", [e.name for e in evs])
        c.add_same_str("side", side, len(evs))
        c.add_num("tid", [getattr(x, "stream", None) if side == "gpu" and getattr(x, "stream", None) is not None
                          else _pid(e.tid) for x, e in zip(a, evs)], np.int64)
        c.add_str("coll", [classify.canonical_collective(x.coll or "") for x in a])
        c.add_str("pg_name", [x.pg_name or "" for x in a])
        c.add_str("pg_desc", [x.pg_desc or "" for x in a])
        c.add_str("pg_ranks", _raw_texts([x.pg_ranks for x in a]))
        c.add_str("dtype", [x.dtype or "" for x in a])
        c.add_num("group_size", _ints([x.group_size for x in a], -1), np.int64)
        c.add_num("in_nelems", [x.in_nelems if x.in_nelems is not None else (x.in_size_old if x.in_size_old is not None else -1) for x in a], np.int64)
        c.add_num("out_nelems", [x.out_nelems if x.out_nelems is not None else (x.out_size_old if x.out_size_old is not None else -1) for x in a], np.int64)
        c.add_num("seq", _ints([x.coll_seq for x in a], -1), np.int64)
        c.add_num("ext_id", _ext_id(a), np.int64)
        c.add_num("corr", [getattr(x, "corr_id", -1) for x in a], np.int64)
        c.rows += len(evs)

    def memory(self, evs: list[Ev]) -> None:
        evs = [e for e in evs if e.name == "[memory]"]
        if not evs:
            return
        c = self._cols("memory")
        c.add_num("ts", self._ns(evs), np.int64)
        c.add_num("pid", _ids([e.pid for e in evs]), np.int64)
        c.add_num("tid", _ids([e.tid for e in evs]), np.int64)
        a = decode_args(evs, MemoryArgs)
        c.add_num("addr", _ints([x.addr for x in a], 0), np.int64)
        c.add_num("bytes", _ints([x.mem_bytes for x in a], 0), np.int64)
        c.add_num("total_allocated", _ints([x.total_alloc for x in a], -1), np.int64)
        c.add_num("total_reserved", _ints([x.total_reserved for x in a], -1), np.int64)
        c.add_num("device_id", _ints([x.device_id for x in a], -1), np.int64)
        c.add_num("device_type", _ints([x.device_type for x in a], -1), np.int64)
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
        cats = [e.cat for e in evs]
        ids = [e.id for e in evs]
        num = np.array(ids)
        if num.dtype != np.int64 or num.ndim != 1:  # a str or absent id: keep the keys as they are
            num, keys = None, list(zip(cats, ids))
        else:
            keys = None
        self.flow_pts.append(FlowPoints(end, np.fromiter(map(self.flow_cats.__getitem__, cats), np.int32, len(cats)),
                                        num, keys, self._ns(evs), _ids([e.pid for e in evs]),
                                        _ids([e.tid for e in evs])))

    def _pair_flows(self) -> Optional[tuple[Columns, int]]:
        """Match flow starts ("s") to ends ("f") by (cat, id), a repeated start's last occurrence
        winning; the pairs' cat and id columns and their count, None when there are no pairs."""
        def side(end: int) -> tuple[list[FlowPoints], list[np.ndarray]]:
            parts = [p for p in self.flow_pts if p.end == end]
            cols = [np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, np.int64)
                    for f in ("ns", "pid", "tid")]
            return parts, cols
        sparts, scols = side(0)
        eparts, ecols = side(1)
        labels = list(self.flow_cats)
        if all(p.ids is not None for p in sparts + eparts):  # numeric ids, the usual: pair in numpy
            sc, ec = (np.concatenate([p.cats for p in ps]) if ps else np.zeros(0, np.int32) for ps in (sparts, eparts))
            sid, eid = (np.concatenate([p.ids for p in ps]) if ps else np.zeros(0, np.int64) for ps in (sparts, eparts))
            si = _match_last(sc, sid, ec, eid)
            ok = si >= 0
            if not ok.any():
                return None
            fl = Columns()
            fl.add_coded("cat", ec[ok], labels)
            fl.add_num("id", eid[ok], np.int64)
        else:
            def keys(parts: list[FlowPoints]) -> list[tuple]:
                return list(itertools.chain.from_iterable(
                    p.keys if p.keys is not None else zip(map(labels.__getitem__, p.cats.tolist()), p.ids.tolist())
                    for p in parts))
            skeys, ekeys = keys(sparts), keys(eparts)
            start_of = dict(zip(skeys, range(len(skeys))))  # a repeated id keeps its last start
            si = np.fromiter(map(start_of.get, ekeys, itertools.repeat(-1)), np.int64, len(ekeys))
            ok = si >= 0
            if not ok.any():
                return None
            paired = list(itertools.compress(ekeys, ok.tolist()))
            fl = Columns()
            fl.add_str("cat", [k for k, _ in paired])
            fl.add_num("id", _ids([k[1] for k in paired]), np.int64)
        for i, col in enumerate(("ts", "pid", "tid")):
            fl.add_num("src_" + col, scols[i][si[ok]], np.int64)
            fl.add_num("dst_" + col, ecols[i][ok], np.int64)
        n = int(ok.sum())
        fl.rows = n
        return fl, n

    def merge(self, other: "Builder") -> None:
        """Append the rows another builder decoded (a worker's chunk), remapping string codes."""
        self.end_chunk()
        other.end_chunk()
        for name, oc in other.t.items():
            self._table(name).extend(oc)
        remap = np.array([self.flow_cats[c] for c in other.flow_cats] or [0], np.int32)
        self.flow_pts.extend(p._replace(cats=remap[p.cats]) for p in other.flow_pts)
        for key, names in other.threads.items():
            self.threads.setdefault(key, {}).update(names)
        self.n_events += other.n_events
        self.negative_durations += other.negative_durations

    def finish(self) -> dict[str, Table]:
        self.end_chunk()
        tables = {name: c.table() for name, c in self.t.items() if c.rows}
        if "python" in tables:
            tables["python"], self.agent_threads = drop_agent_threads(tables["python"])
        flows = self._pair_flows()
        if flows is not None:
            tables["flows"] = flows[0].table("src_ts")
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
          "collectives", "memory", "threads", "hw", "pm", "calls", "syscalls")


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
    tables["pm"] = pm_table([], [], [], [], [])
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
    # the agent frame sits under a threading.py frame (torch's tracer loses parent ids after the
    # profiler stops: an agent frame with no parent, the step hook's on the training thread, is
    # no thread entry)
    under_entry = (cur >= 0) & is_entry[np.maximum(cur, 0)]
    # climb through threading.py frames; an agent frame whose chain ends at the root is a thread entry
    for _ in range(8):
        climb = (cur >= 0) & is_entry[np.maximum(cur, 0)]
        if not climb.any():
            break
        cur = np.where(climb, parent_row(np.maximum(cur, 0)), cur)
    agent_tids = npx.unique(py["tid"][rows[(cur < 0) & under_entry]])
    if not len(agent_tids):
        return py, []
    return py.take(~np.isin(py["tid"], agent_tids)), agent_tids.tolist()

