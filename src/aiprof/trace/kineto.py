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
from msgspec import Raw

from aiprof.errors import TraceError
from aiprof.trace import classify
from aiprof.trace.table import Strings, Table

CHUNK_BYTES = 8 << 20
_MAX_CUT_TRIES = 12
_HEADER_LIMIT = 64 << 20


class Args(msgspec.Struct, gc=False):
    """The event args that aiprof reads; every other arg is skipped by the decoder."""

    ext: Optional[int] = msgspec.field(default=None, name="External id")
    ext_old: Optional[int] = msgspec.field(default=None, name="external id")
    corr: Optional[int] = msgspec.field(default=None, name="correlation")
    corr_old: Optional[int] = msgspec.field(default=None, name="correlation id")
    cbid: Optional[int] = None
    seq: Optional[int] = msgspec.field(default=None, name="Sequence number")
    fwd_tid: Optional[int] = msgspec.field(default=None, name="Fwd thread id")
    dims: Raw = msgspec.field(default=Raw(), name="Input Dims")
    dims_old: Raw = msgspec.field(default=Raw(), name="Input dims")
    types: Raw = msgspec.field(default=Raw(), name="Input type")
    flops: Optional[float] = None
    py_id: Optional[int] = msgspec.field(default=None, name="Python id")
    py_parent: Optional[int] = msgspec.field(default=None, name="Python parent id")
    py_module: Optional[int] = msgspec.field(default=None, name="Python module id")
    device: Optional[int] = None
    stream: Optional[int] = None
    queued: Optional[int] = None
    grid: Optional[list[int]] = None
    block: Optional[list[int]] = None
    regs: Optional[int] = msgspec.field(default=None, name="registers per thread")
    smem: Optional[int] = msgspec.field(default=None, name="shared memory")
    blocks_sm: Optional[float] = msgspec.field(default=None, name="blocks per SM")
    warps_sm: Optional[float] = msgspec.field(default=None, name="warps per SM")
    occupancy: Optional[float] = msgspec.field(default=None, name="est. achieved occupancy %")
    nbytes: Optional[int] = msgspec.field(default=None, name="bytes")
    # collectives (record_param_comms / NCCL kernels)
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
    # [memory] instant events
    mem_bytes: Optional[int] = msgspec.field(default=None, name="Bytes")
    total_alloc: Optional[int] = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Optional[int] = msgspec.field(default=None, name="Total Reserved")
    addr: Optional[int] = msgspec.field(default=None, name="Addr")
    device_id: Optional[int] = msgspec.field(default=None, name="Device Id")
    device_type: Optional[int] = msgspec.field(default=None, name="Device Type")
    # metadata (ph "M") and GPU-side sync events
    label: Optional[Union[str, int]] = msgspec.field(default=None, name="name")
    wait_stream: Optional[int] = msgspec.field(default=None, name="wait_on_stream")
    wait_corr: Optional[int] = msgspec.field(default=None, name="wait_on_cuda_event_record_corr_id")


class Ev(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: float = 0.0
    dur: float = 0.0
    id: Union[int, str, None] = None
    args: Optional[Args] = None


_EVENTS = msgspec.json.Decoder(list[Ev])
_ANY = msgspec.json.Decoder()
_NO_ARGS = Args()


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
        index, parts = self.strings.setdefault(name, ({}, []))
        setdefault = index.setdefault
        parts.append(np.fromiter((setdefault(v, len(index)) for v in values), dtype=np.int32))

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
            c.add_num("pid", [_pid(e.pid) for e in evs], np.int64)
            c.add_num("tid", [_pid(e.tid) for e in evs], np.int64)
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
        a = [e.args or _NO_ARGS for e in evs]
        c.add_num("ext_id", [x.ext if x.ext is not None else (x.ext_old if x.ext_old is not None else -1) for x in a], np.int64)
        c.add_num("seq", _opt([x.seq for x in a], -1), np.int64)
        c.add_num("fwd_tid", _opt([x.fwd_tid for x in a], -1), np.int64)
        c.add_num("flops", [np.nan if x.flops is None else x.flops for x in a], np.float64)
        c.add_str("input_dims", [bytes(x.dims or x.dims_old).decode() for x in a])
        c.add_str("input_types", [bytes(x.types).decode() for x in a])
        self._collectives([e for e in evs if e.args is not None and e.args.coll is not None], side="cpu")

    def annotations(self, evs: list[Ev], gpu: bool = False) -> None:
        c = self._cols("annotations")
        self._common(c, evs, host=True)
        a = [e.args or _NO_ARGS for e in evs]
        c.add_num("ext_id", [x.ext if x.ext is not None else (x.ext_old if x.ext_old is not None else -1) for x in a], np.int64)
        c.add_num("gpu", [gpu] * len(evs), np.bool_)
        self._collectives([e for e in evs if e.args is not None and e.args.coll is not None], side="cpu")

    def gpu_annotations(self, evs: list[Ev]) -> None:
        self.annotations(evs, gpu=True)

    def python(self, evs: list[Ev]) -> None:
        c = self._cols("python")
        self._common(c, evs, host=True)
        a = [e.args or _NO_ARGS for e in evs]
        c.add_num("py_id", _opt([x.py_id for x in a], -1), np.int64)
        c.add_num("parent_id", _opt([x.py_parent for x in a], -1), np.int64)
        c.add_num("module_id", _opt([x.py_module for x in a], -1), np.int64)

    def runtime(self, evs: list[Ev], driver: bool = False) -> None:
        c = self._cols("runtime")
        self._common(c, evs, host=True)
        a = [e.args or _NO_ARGS for e in evs]
        c.add_num("corr", [x.corr if x.corr is not None else (x.corr_old if x.corr_old is not None else -1) for x in a], np.int64)
        c.add_num("ext_id", [x.ext if x.ext is not None else (x.ext_old if x.ext_old is not None else -1) for x in a], np.int64)
        c.add_num("cbid", _opt([x.cbid for x in a], -1), np.int64)
        c.add_num("driver", [driver] * len(evs), np.bool_)

    def driver(self, evs: list[Ev]) -> None:
        self.runtime(evs, driver=True)

    def _gpu_common(self, c: Columns, evs: list[Ev], a: list[Args]) -> None:
        self._common(c, evs, host=False)
        c.add_num("device", [x.device if x.device is not None else _pid(e.pid) for x, e in zip(a, evs)], np.int64)
        c.add_num("stream", [x.stream if x.stream is not None else _pid(e.tid) for x, e in zip(a, evs)], np.int64)
        c.add_num("corr", [x.corr if x.corr is not None else (x.corr_old if x.corr_old is not None else -1) for x in a], np.int64)
        c.add_num("ext_id", [x.ext if x.ext is not None else (x.ext_old if x.ext_old is not None else -1) for x in a], np.int64)

    def kernels(self, evs: list[Ev]) -> None:
        c = self._cols("kernels")
        a = [e.args or _NO_ARGS for e in evs]
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
        c.add_str("cls", [classify.kernel_class(e.name, x.coll is not None) for e, x in zip(evs, a)])
        self._collectives([e for e in evs if e.args is not None and e.args.coll is not None], side="gpu")

    def memops(self, evs: list[Ev], kind: str) -> None:
        c = self._cols("memops")
        a = [e.args or _NO_ARGS for e in evs]
        self._gpu_common(c, evs, a)
        c.add_num("bytes", _opt([x.nbytes for x in a], -1), np.int64)
        c.add_str("kind", [kind] * len(evs))

    def memcpy(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMCPY)

    def memset(self, evs: list[Ev]) -> None:
        self.memops(evs, classify.MEMSET)

    def gpu_sync(self, evs: list[Ev]) -> None:
        c = self._cols("gpu_sync")
        a = [e.args or _NO_ARGS for e in evs]
        self._gpu_common(c, evs, a)
        c.add_num("wait_stream", _opt([x.wait_stream for x in a], -1), np.int64)
        c.add_num("wait_corr", _opt([x.wait_corr for x in a], -1), np.int64)

    def _collectives(self, evs: list[Ev], side: str) -> None:
        if not evs:
            return
        c = self._cols("collectives")
        c.add_num("ts", self._ns([e.ts for e in evs]), np.int64)
        c.add_num("dur", np.rint(np.asarray([e.dur for e in evs]) * 1000.0), np.int64)
        c.add_str("name", [e.name for e in evs])
        c.add_str("side", [side] * len(evs))
        a = [e.args for e in evs]
        c.add_num("tid", [x.stream if side == "gpu" and x.stream is not None else _pid(e.tid) for x, e in zip(a, evs)], np.int64)
        c.add_str("coll", [classify.canonical_collective(x.coll or "") for x in a])
        c.add_str("pg_name", [x.pg_name or "" for x in a])
        c.add_str("pg_desc", [x.pg_desc or "" for x in a])
        c.add_str("pg_ranks", [bytes(x.pg_ranks).decode() for x in a])
        c.add_str("dtype", [x.dtype or "" for x in a])
        c.add_num("group_size", _opt([x.group_size for x in a], -1), np.int64)
        c.add_num("in_nelems", [x.in_nelems if x.in_nelems is not None else (x.in_size_old if x.in_size_old is not None else -1) for x in a], np.int64)
        c.add_num("out_nelems", [x.out_nelems if x.out_nelems is not None else (x.out_size_old if x.out_size_old is not None else -1) for x in a], np.int64)
        c.add_num("seq", _opt([x.coll_seq for x in a], -1), np.int64)
        c.add_num("ext_id", [x.ext if x.ext is not None else -1 for x in a], np.int64)
        c.add_num("corr", [x.corr if x.corr is not None else -1 for x in a], np.int64)
        c.rows += len(evs)

    def memory(self, evs: list[Ev]) -> None:
        evs = [e for e in evs if e.name == "[memory]" and e.args is not None]
        if not evs:
            return
        c = self._cols("memory")
        c.add_num("ts", self._ns([e.ts for e in evs]), np.int64)
        c.add_num("pid", [_pid(e.pid) for e in evs], np.int64)
        c.add_num("tid", [_pid(e.tid) for e in evs], np.int64)
        a = [e.args for e in evs]
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
        for e in evs:
            if e.name in ("thread_name", "process_name", "process_labels") and e.args is not None:
                key = (_pid(e.pid), _pid(e.tid) if e.name == "thread_name" else -1)
                self.threads.setdefault(key, {})[e.name] = str(e.args.label or "")

    def flow_start(self, evs: list[Ev]) -> None:
        self._flow_points(evs, 0)

    def flow_end(self, evs: list[Ev]) -> None:
        self._flow_points(evs, 1)

    def _flow_points(self, evs: list[Ev], end: int) -> None:
        # Paired in finish(): a flow's start and end may sit in different chunks.
        ns = self._ns([e.ts for e in evs])
        self.flow_pts.extend((e.cat, e.id, end, int(t), _pid(e.pid), _pid(e.tid)) for e, t in zip(evs, ns))

    def finish(self) -> dict[str, Table]:
        tables = {name: c.table() for name, c in self.t.items() if c.rows}
        starts = {(cat, fid): (t, pid, tid) for cat, fid, end, t, pid, tid in self.flow_pts if not end}
        rows = [(cat, fid, *starts[(cat, fid)], t, pid, tid)
                for cat, fid, end, t, pid, tid in self.flow_pts if end and (cat, fid) in starts]
        if rows:
            fl = Columns()
            fl.add_str("cat", [r[0] for r in rows])
            fl.add_num("id", [_pid(r[1]) for r in rows], np.int64)
            for i, col in enumerate(("src_ts", "src_pid", "src_tid", "dst_ts", "dst_pid", "dst_tid")):
                fl.add_num(col, [r[2 + i] for r in rows], np.int64)
            fl.rows = len(rows)
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
          "collectives", "memory", "threads")


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
               chunk_bytes: int = CHUNK_BYTES) -> ParsedTrace:
    """Parse one Kineto trace file into tables. Raises :class:`TraceError` on bad input."""
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
        parsed = _parse(reader, chunk_bytes)
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


def _parse(r: _Reader, chunk_bytes: int) -> ParsedTrace:
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
    tail = b""
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
    tables = b.finish()
    if b.n_events == 0 or not tables:
        raise TraceError(path, "no profiler events in \"traceEvents\" (is this a torch.profiler trace?)")
    return ParsedTrace(tables=tables, meta=meta, n_events=b.n_events)


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
