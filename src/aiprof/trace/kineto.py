"""Reader for Kineto / torch.profiler Chrome-trace JSON (``.json`` or ``.json.gz``).

The file is streamed: the ``traceEvents`` array is cut into chunks of a few MB at event
boundaries and each chunk is decoded by msgspec straight into small typed structs (unknown
fields are skipped in C), then turned into columns. Peak memory is bounded by one chunk plus
the columns, not by the JSON size.

Cutting: a boundary candidate is a ``},`` in the byte stream. A candidate inside a nested
object or a string leaves unbalanced brackets or an open string, so the chunk fails to decode
and the next candidate to the left is tried. Nothing is ever silently mis-split.
"""
from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import msgspec
import numpy as np
import pyarrow as pa
from msgspec import Raw

from aiprof.errors import TraceError
from aiprof.trace import classify
from aiprof.trace.table import Strings, Table

CHUNK_BYTES = 8 << 20
_MAX_CUT_TRIES = 12
_HEADER_LIMIT = 64 << 20


class _A(msgspec.Struct, gc=False):
    """Args shared by every event kind that links host and GPU work."""

    ext: Optional[int] = msgspec.field(default=None, name="External id")
    ext_old: Optional[int] = msgspec.field(default=None, name="external id")

    @property
    def ext_id(self) -> int:
        return self.ext if self.ext is not None else (self.ext_old if self.ext_old is not None else -1)


class _Coll(_A, gc=False):
    """Collective args (record_param_comms on ops/annotations, and NCCL kernels)."""

    coll: Optional[str] = msgspec.field(default=None, name="Collective name")
    in_nelems: Optional[int] = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Optional[int] = msgspec.field(default=None, name="Out msg nelems")
    in_size_old: Optional[int] = msgspec.field(default=None, name="In msg size")
    out_size_old: Optional[int] = msgspec.field(default=None, name="Out msg size")
    group_size: Optional[int] = msgspec.field(default=None, name="Group size")
    dtype: Optional[str] = None
    pg_name: Optional[str] = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Optional[str] = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Raw = msgspec.field(default=Raw(), name="Process Group Ranks")
    coll_seq: Optional[int] = msgspec.field(default=None, name="Seq")


class OpArgs(_Coll, gc=False):
    seq: Optional[int] = msgspec.field(default=None, name="Sequence number")
    fwd_tid: Optional[int] = msgspec.field(default=None, name="Fwd thread id")
    dims: Raw = msgspec.field(default=Raw(), name="Input Dims")
    dims_old: Raw = msgspec.field(default=Raw(), name="Input dims")
    types: Raw = msgspec.field(default=Raw(), name="Input type")
    flops: Optional[float] = None


class PyArgs(msgspec.Struct, gc=False):
    py_id: Optional[int] = msgspec.field(default=None, name="Python id")
    py_parent: Optional[int] = msgspec.field(default=None, name="Python parent id")
    py_module: Optional[int] = msgspec.field(default=None, name="Python module id")


class _GpuArgs(_Coll, gc=False):
    corr: Optional[int] = msgspec.field(default=None, name="correlation")
    corr_old: Optional[int] = msgspec.field(default=None, name="correlation id")
    device: Optional[int] = None
    stream: Optional[int] = None

    @property
    def corr_id(self) -> int:
        return self.corr if self.corr is not None else (self.corr_old if self.corr_old is not None else -1)


class RuntimeArgs(_GpuArgs, gc=False):
    cbid: Optional[int] = None


class KernelArgs(_GpuArgs, gc=False):
    queued: Optional[int] = None
    grid: Optional[list[int]] = None
    block: Optional[list[int]] = None
    regs: Optional[int] = msgspec.field(default=None, name="registers per thread")
    smem: Optional[int] = msgspec.field(default=None, name="shared memory")
    blocks_sm: Optional[float] = msgspec.field(default=None, name="blocks per SM")
    warps_sm: Optional[float] = msgspec.field(default=None, name="warps per SM")
    occupancy: Optional[float] = msgspec.field(default=None, name="est. achieved occupancy %")


class MemopArgs(_GpuArgs, gc=False):
    nbytes: Optional[int] = msgspec.field(default=None, name="bytes")


class SyncArgs(_GpuArgs, gc=False):
    wait_stream: Optional[int] = msgspec.field(default=None, name="wait_on_stream")
    wait_corr: Optional[int] = msgspec.field(default=None, name="wait_on_cuda_event_record_corr_id")


class MemoryArgs(msgspec.Struct, gc=False):
    mem_bytes: Optional[int] = msgspec.field(default=None, name="Bytes")
    total_alloc: Optional[int] = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Optional[int] = msgspec.field(default=None, name="Total Reserved")
    addr: Optional[int] = msgspec.field(default=None, name="Addr")
    device_id: Optional[int] = msgspec.field(default=None, name="Device Id")
    device_type: Optional[int] = msgspec.field(default=None, name="Device Type")


class MetaArgs(msgspec.Struct, gc=False):
    label: Optional[Union[str, int]] = msgspec.field(default=None, name="name")


class Ev(msgspec.Struct, gc=False):
    """One trace event; ``args`` stays raw until its kind's handler decodes it (see _args)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: float = 0.0
    dur: float = 0.0
    id: Union[int, str, None] = None
    args: Raw = Raw()


_EVENTS = msgspec.json.Decoder(list[Ev])
_ANY = msgspec.json.Decoder()
_ARGS_DECODERS: dict[type, msgspec.json.Decoder] = {}


def _args(evs: list[Ev], kind: type) -> list:
    """Decode the args of a group of events of one kind in a single call (C speed)."""
    dec = _ARGS_DECODERS.get(kind)
    if dec is None:
        dec = _ARGS_DECODERS[kind] = msgspec.json.Decoder(list[kind])
    return dec.decode(b"[" + b",".join([e.args if len(e.args) else b"{}" for e in evs]) + b"]")


class ProgressFn:  # pragma: no cover - typing helper
    def __call__(self, done_bytes: int, total_bytes: int) -> None: ...


@dataclass
class Columns:
    """Accumulates the rows of one table across chunks as per-chunk numpy pieces."""

    numeric: dict[str, list[np.ndarray]] = field(default_factory=dict)
    strings: dict[str, tuple[dict[str, int], list[np.ndarray]]] = field(default_factory=dict)
    rows: int = 0

    def add_num(self, name: str, values, dtype) -> None:
        self.numeric.setdefault(name, []).append(np.asarray(values, dtype=dtype))

    def add_str(self, name: str, values) -> None:
        # Encode the chunk in C (pyarrow), then map its few distinct labels to global codes.
        index, parts = self.strings.setdefault(name, ({}, []))
        enc = pa.array(values, pa.string()).dictionary_encode()
        remap = np.array([index.setdefault(s, len(index)) for s in enc.dictionary.to_pylist()] or [0], dtype=np.int32)
        parts.append(remap[enc.indices.to_numpy(zero_copy_only=False)])

    def table(self, sort_key: str = "ts") -> Table:
        """The accumulated rows, sorted by ``sort_key`` (stable) so row order never depends on chunking."""
        cols: dict[str, np.ndarray | Strings] = {}
        for name, parts in self.numeric.items():
            cols[name] = np.concatenate(parts) if parts else np.zeros(0)
        for name, (index, parts) in self.strings.items():
            cols[name] = Strings(np.concatenate(parts) if parts else np.zeros(0, np.int32), list(index))
        t = Table(cols)
        if sort_key in cols and len(t) > 1:
            key = cols[sort_key]
            if np.any(key[1:] < key[:-1]):
                t = t.take(np.argsort(key, kind="stable"))
        return t


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


class _Builder:
    """Turns decoded events into the store's tables, chunk by chunk."""

    def __init__(self) -> None:
        self.t: dict[str, Columns] = {}
        self.ts0: Optional[float] = None  # integer-µs anchor that keeps ns conversion exact
        self.threads: dict[tuple[int, int], dict] = {}
        self.flow_pts: list[tuple] = []
        self.kernel_cls: dict[tuple[str, bool], str] = {}
        self.n_events = 0

    def _ns(self, ts: list[float]) -> np.ndarray:
        a = np.asarray(ts, dtype=np.float64)
        if self.ts0 is None:
            self.ts0 = float(np.floor(a.min())) if len(a) else 0.0
        return np.rint((a - self.ts0) * 1000.0).astype(np.int64) + int(self.ts0) * 1000

    def _common(self, c: Columns, evs: list[Ev], host: bool) -> None:
        c.add_num("ts", self._ns([e.ts for e in evs]), np.int64)
        c.add_num("dur", np.rint(np.asarray([e.dur for e in evs], dtype=np.float64) * 1000.0), np.int64)
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
        self.n_events += len(evs)
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
        a = _args(evs, OpArgs)
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
        a = _args(evs, _Coll)
        c.add_num("ext_id", [x.ext_id for x in a], np.int64)
        c.add_num("gpu", [gpu] * len(evs), np.bool_)
        self._collectives(evs, a, side="cpu")

    def gpu_annotations(self, evs: list[Ev]) -> None:
        self.annotations(evs, gpu=True)

    def python(self, evs: list[Ev]) -> None:
        c = self._cols("python")
        self._common(c, evs, host=True)
        a = _args(evs, PyArgs)
        c.add_num("py_id", _opt([x.py_id for x in a], -1), np.int64)
        c.add_num("parent_id", _opt([x.py_parent for x in a], -1), np.int64)
        c.add_num("module_id", _opt([x.py_module for x in a], -1), np.int64)

    def runtime(self, evs: list[Ev], driver: bool = False) -> None:
        c = self._cols("runtime")
        self._common(c, evs, host=True)
        a = _args(evs, RuntimeArgs)
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
        a = _args(evs, KernelArgs)
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
        a = _args(evs, MemopArgs)
        self._gpu_common(c, evs, a)
        c.add_num("bytes", _opt([x.nbytes for x in a], -1), np.int64)
        c.add_str("kind", [kind] * len(evs))

    def memcpy(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMCPY)

    def memset(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMSET)

    def gpu_sync(self, evs: list[Ev]) -> None:
        c = self._cols("gpu_sync")
        a = _args(evs, SyncArgs)
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
        c.add_num("ts", self._ns([e.ts for e in evs]), np.int64)
        c.add_num("dur", np.rint(np.asarray([e.dur for e in evs]) * 1000.0), np.int64)
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
        c.add_num("ts", self._ns([e.ts for e in evs]), np.int64)
        c.add_num("pid", [_pid(e.pid) for e in evs], np.int64)
        c.add_num("tid", [_pid(e.tid) for e in evs], np.int64)
        a = _args(evs, MemoryArgs)
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
        for e, x in zip(evs, _args(evs, MetaArgs) if evs else []):
            key = (_pid(e.pid), _pid(e.tid) if e.name == "thread_name" else -1)
            self.threads.setdefault(key, {})[e.name] = str(x.label or "")

    def flow_start(self, evs: list[Ev]) -> None:
        self._flow_points(evs, 0)

    def flow_end(self, evs: list[Ev]) -> None:
        self._flow_points(evs, 1)

    def _flow_points(self, evs: list[Ev], end: int) -> None:
        # Paired in finish(): a flow's start and end may sit in different chunks.
        self.flow_pts.append((end, [(e.cat, e.id) for e in evs], self._ns([e.ts for e in evs]),
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

    def merge(self, other: "_Builder") -> None:
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

    def finish(self) -> dict[str, Table]:
        tables = {name: c.table() for name, c in self.t.items() if c.rows}
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


_HANDLERS: dict[str, Callable[[_Builder, list[Ev]], None]] = {
    "cpu_op": _Builder.ops,
    "user_annotation": _Builder.annotations,
    "gpu_user_annotation": _Builder.gpu_annotations,
    "python_function": _Builder.python,
    "cuda_runtime": _Builder.runtime,
    "cuda_driver": _Builder.driver,
    "kernel": _Builder.kernels,
    "gpu_memcpy": _Builder.memcpy,
    "gpu_memset": _Builder.memset,
    "cuda_sync": _Builder.gpu_sync,
    "i": _Builder.instants,
    "M": _Builder.metadata,
    "s": _Builder.flow_start,
    "f": _Builder.flow_end,
}

# Tables every capture has (possibly empty), in the order the docs list them.
TABLES = ("ops", "annotations", "python", "runtime", "kernels", "memops", "gpu_sync", "flows",
          "collectives", "memory", "threads", "hw")


@dataclass
class ParsedTrace:
    """What one trace file yields: its tables and its top-level metadata."""

    tables: dict[str, Table]
    meta: dict
    n_events: int


class _Reader:
    """Sequential reader over a plain or gzip file that reports progress in file bytes."""

    def __init__(self, path: str, progress: Optional[Callable[[int, int], None]]) -> None:
        self.path = path
        self.f = open(path, "rb")
        self.total = os.fstat(self.f.fileno()).st_size
        magic = self.f.read(2)
        self.f.seek(0)
        self.gz = magic == b"\x1f\x8b"
        self.inflate = zlib.decompressobj(wbits=31) if self.gz else None
        self.progress = progress
        self.eof = False

    def read(self, n: int) -> bytes:
        if self.eof:
            return b""
        if not self.gz:
            data = self.f.read(n)
            if not data:
                self.eof = True
            self._tick()
            return data
        out = []
        size = 0
        while size < n:
            raw = self.f.read(1 << 20)
            if not raw:
                if not self.inflate.eof:
                    raise TraceError(self.path, "truncated gzip stream (the compressed file ends early)")
                self.eof = True
                break
            try:
                piece = self.inflate.decompress(raw)
                while self.inflate.eof and self.inflate.unused_data:  # concatenated gzip members
                    rest = self.inflate.unused_data
                    self.inflate = zlib.decompressobj(wbits=31)
                    piece += self.inflate.decompress(rest)
            except zlib.error as exc:
                raise TraceError(self.path, f"corrupt gzip data ({exc})") from None
            out.append(piece)
            size += len(piece)
        self._tick()
        return b"".join(out)

    def rewind(self) -> None:
        """Start reading the file again from its first byte."""
        self.f.seek(0)
        self.inflate = zlib.decompressobj(wbits=31) if self.gz else None
        self.eof = False

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress(self.f.tell(), self.total)

    def close(self) -> None:
        self.f.close()


def _skip_ws(buf: bytes, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in b" \t\r\n":
        i += 1
    return i


def _json_error(path: str, data: bytes) -> TraceError:
    """Explain why ``data`` is not a trace: invalid JSON, or JSON of another shape."""
    try:
        _ANY.decode(data)
    except msgspec.DecodeError as exc:
        return TraceError(path, f"not valid JSON ({exc})")
    return TraceError(path, "valid JSON but not a Kineto/Chrome trace (no \"traceEvents\" array)")


def read_trace(path: str, progress: Optional[Callable[[int, int], None]] = None,
               chunk_bytes: int = CHUNK_BYTES, workers: Optional[int] = None) -> ParsedTrace:
    """Parse one Kineto trace file into tables. Raises :class:`TraceError` on bad input.

    ``workers`` > 1 decodes large Kineto-formatted files in that many processes (default:
    $AIPROF_INGEST_WORKERS, else the number of CPUs, at most 4); small files are always read in
    this process.
    """
    if workers is None:
        workers = int(os.environ.get("AIPROF_INGEST_WORKERS") or min(4, os.cpu_count() or 1))
    try:
        reader = _Reader(path, progress)
    except FileNotFoundError:
        raise TraceError(path, "no such file (it may have been removed)") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, expected a trace file") from None
    except PermissionError:
        raise TraceError(path, "permission denied") from None
    try:
        st0 = os.fstat(reader.f.fileno())
        parsed = _parse(reader, chunk_bytes, workers)
        st1 = os.stat(path) if os.path.exists(path) else None
        if st1 is None:
            raise TraceError(path, "file disappeared while it was being read")
        if (st1.st_size, st1.st_mtime_ns) != (st0.st_size, st0.st_mtime_ns):
            raise TraceError(path, "file changed while it was being read")
        return parsed
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(path, f"read failed ({exc})") from None
    finally:
        reader.close()


def _parse(r: _Reader, chunk_bytes: int, workers: int = 1) -> ParsedTrace:
    path = r.path
    buf = r.read(chunk_bytes)
    if not buf.strip():
        raise TraceError(path, "empty file")
    start = _skip_ws(buf, 3 if buf.startswith(b"\xef\xbb\xbf") else 0)
    header = b""
    if buf[start:start + 1] == b"[":  # bare array of events (Chrome JSON array format)
        pos = start + 1
    elif buf[start:start + 1] == b"{":
        key = buf.find(b'"traceEvents"')
        while key < 0 and not r.eof and len(buf) < _HEADER_LIMIT:
            buf += r.read(chunk_bytes)
            key = buf.find(b'"traceEvents"')
        if key < 0:
            while not r.eof and len(buf) < _HEADER_LIMIT:
                buf += r.read(chunk_bytes)
            raise _json_error(path, buf)
        i = _skip_ws(buf, key + len(b'"traceEvents"'))
        if buf[i:i + 1] != b":":
            raise _json_error(path, buf)
        i = _skip_ws(buf, i + 1)
        if buf[i:i + 1] != b"[":
            raise TraceError(path, "\"traceEvents\" is not an array")
        header = buf[:key]
        pos = i + 1
    else:
        raise _json_error(path, buf[:4096] if len(buf) > 4096 else buf)

    b = _Builder()
    buf = buf[pos:]
    if workers > 1 and r.total >= PARALLEL_MIN_BYTES and buf.startswith(_KINETO_FIRST):
        done = _parse_parallel(r, b, buf, chunk_bytes, workers)
        if done is not None:
            buf = done
            tail = _decode_last(b, buf, path)
            meta = _decode_meta(path, header, tail)
            return _finish(path, b, meta)
        # a block did not decode: this file only looks Kineto-formatted; start over sequentially
        r.rewind()
        return _parse(r, chunk_bytes, workers=1)
    while True:
        if not r.eof and len(buf) < chunk_bytes:
            buf += r.read(chunk_bytes)
            continue
        consumed = _decode_bulk(b, buf, path, at_eof=r.eof)
        if consumed is None:  # no cut decoded: take more input, or give up
            if r.eof:
                break
            if len(buf) > 8 * chunk_bytes:
                raise _syntax_error(path, buf)
            buf += r.read(chunk_bytes)
            continue
        buf = buf[consumed:]
        if r.eof:
            break
    # What is left holds the last event(s), the closing bracket and the document's tail.
    tail = _decode_last(b, buf, path)
    meta = _decode_meta(path, header, tail)
    return _finish(path, b, meta)


def _finish(path: str, b: _Builder, meta: dict) -> ParsedTrace:
    tables = b.finish()
    if b.n_events == 0 or not tables:
        raise TraceError(path, "no profiler events in \"traceEvents\" (is this a torch.profiler trace?)")
    return ParsedTrace(tables=tables, meta=meta, n_events=b.n_events)


# Kineto writes one event per block: "  {" at indent 2, its fields deeper, and "\n  },\n  {"
# between events. JSON strings cannot hold a raw newline, so that separator is never inside a
# string; with Kineto's indentation it is never inside a nested object either. That makes the
# cut safe without decoding, so blocks can be decoded in other processes. Should a block fail to
# decode anyway (a file that only looks Kineto-formatted), the whole file is re-read sequentially.
_KINETO_FIRST = b"\n  {\n"
_KINETO_SEP = b"\n  },\n  {"
PARALLEL_MIN_BYTES = 48 << 20


def _decode_block(block: bytes) -> Optional[_Builder]:
    """Worker: decode one block of complete events into a fresh builder (None if it fails)."""
    try:
        evs = _EVENTS.decode(b"[" + block + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    b = _Builder()
    b.add(evs)
    return b


def _parse_parallel(r: _Reader, b: _Builder, buf: bytes, chunk_bytes: int, workers: int) -> Optional[bytes]:
    """Decode Kineto-formatted blocks in ``workers`` processes; return the unconsumed tail."""
    import multiprocessing
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads' locks
    pending: deque = deque()
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        while True:
            while not r.eof and len(buf) < chunk_bytes:
                buf += r.read(chunk_bytes)
            cut = buf.rfind(_KINETO_SEP)
            if cut < 0:
                break  # only the last event and the document's tail are left
            pending.append(pool.submit(_decode_block, buf[: cut + 4]))
            buf = buf[cut + 5:]
            while len(pending) > 2 * workers:  # bound memory: at most a few blocks in flight
                part = pending.popleft().result()
                if part is None:
                    pool.shutdown(cancel_futures=True)
                    return None
                b.merge(part)
        for fut in pending:
            part = fut.result()
            if part is None:
                return None
            b.merge(part)
    return buf


def _decode_bulk(b: _Builder, buf: bytes, path: str, at_eof: bool) -> Optional[int]:
    """Decode events up to the last good ``},`` cut; return bytes consumed, or None."""
    end = len(buf)
    for _ in range(_MAX_CUT_TRIES):
        cut = buf.rfind(b"},", 0, end)
        if cut < 0:
            return None
        try:
            evs = _EVENTS.decode(b"[" + buf[: cut + 1] + b"]")
        except (msgspec.DecodeError, msgspec.ValidationError):
            end = cut
            continue
        b.add(evs)
        return cut + 2
    return None


def _decode_last(b: _Builder, buf: bytes, path: str) -> bytes:
    """Decode the final events before ``]``; return the bytes after the array."""
    end = len(buf)
    tries = 0
    while True:
        close = buf.rfind(b"]", 0, end)
        if close < 0:
            break
        try:
            evs = _EVENTS.decode(b"[" + buf[:close + 1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            end = close
            tries += 1
            if tries > 64 and len(buf) > (1 << 20):
                break
            continue
        b.add(evs)
        return buf[close + 1:]
    if b.n_events:
        raise TraceError(path, "truncated: the JSON ends inside \"traceEvents\"")
    raise _syntax_error(path, buf)


def _syntax_error(path: str, buf: bytes) -> TraceError:
    try:
        _ANY.decode(b"[" + buf)
    except msgspec.DecodeError as exc:
        return TraceError(path, f"not valid JSON inside \"traceEvents\" ({exc})")
    except msgspec.ValidationError as exc:
        return TraceError(path, f"unexpected event shape in \"traceEvents\" ({exc})")
    return TraceError(path, "truncated: the JSON ends inside \"traceEvents\"")


def _decode_meta(path: str, header: bytes, tail: bytes) -> dict:
    if not header:  # bare-array trace: only whitespace may follow
        if tail.strip():
            raise TraceError(path, "not valid JSON (data after the event array)")
        return {}
    doc = header + b'"traceEvents": []' + tail
    try:
        meta = _ANY.decode(doc)
    except msgspec.DecodeError as exc:
        if not tail.strip():
            raise TraceError(path, "truncated: the JSON ends after \"traceEvents\"") from None
        raise TraceError(path, f"not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise TraceError(path, "not a Kineto trace (top level is not an object)")
    meta.pop("traceEvents", None)
    return meta
