"""The columnar store: one Parquet file per table per rank, cached beside the input.

``open_capture(paths)`` is the single entry point: it finds the rank traces under the given
files/directories, ingests each (or reuses its cache when the input is unchanged) and returns a
:class:`Capture`. Tables are loaded lazily, so re-opening a large cached capture reads only
``meta.json`` until an analysis asks for a table.

Cache layout, for an input ``trace.json.gz``::

    trace.json.gz.aiprof/         (or $AIPROF_CACHE_DIR/<hash>/ when the input's folder is read-only)
      meta.json                   source fingerprint, trace metadata, row counts
      kernels.parquet ...         one file per table

A store is written to a temporary folder and renamed into place, so an interrupted or failed
ingest never leaves a partial store behind.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from aiprof import npx
from aiprof.errors import TraceError, UsageError
from aiprof.trace.builder import empty_table
from aiprof.trace.clip import capture_end_ns, clip_after
from aiprof.trace.hwcsv import hw_path_for, pm_path_for, read_hw_csv, read_pm_csv
from aiprof.trace.nativecsv import native_paths_for, read_native
from aiprof.trace.kineto import TABLES, read_header, read_trace
from aiprof.trace.table import Table

STORE_VERSION = 7  # bump when ingest output changes: old stores are re-ingested (3: validated times, clamped
# durations; 4: the agent's meta.json beside the trace, for the unprofiled step time; 5: pm, calls, syscalls;
# 6: a training thread whose frames lost their parent ids after the stop is no agent thread; 7: the
# job's communication settings from meta.json)
_TRACE_SUFFIXES = (".json", ".json.gz")
_NOT_TRACES = {"meta.json", "report.json"}
PROGRESS_MIN_BYTES = 32 << 20  # less JSON than this ingests in about a second: no bar
_RANK_IN_NAME = re.compile(r"rank[_\-]?(\d+)", re.IGNORECASE)
# torch.profiler.tensorboard_trace_handler names each file f"{worker_name}.{time.time_ns()}.pt.trace.json"
# (+ ".gz"); worker_name defaults to f"{hostname}_{pid}". A hostname may hold dots, so the stamp
# is the last dotted number before the suffix. Files of one worker are captures of one process.
_TENSORBOARD_NAME = re.compile(r"^(?P<worker>.+)\.(?P<ns>\d+)\.pt\.trace\.json(?:\.gz)?$")
# Reading a trace's head for its distributedInfo: in steps of this, up to kineto's header limit.
_PEEK_BYTES = 64 << 10


@dataclass
class RankTrace:
    """One rank's trace: metadata plus lazily loaded tables (see docs/metrics.md, "Tables")."""

    rank: int
    source: str
    meta: dict
    store_dir: Optional[str] = None
    _tables: dict[str, Table] = field(default_factory=dict, repr=False)

    def table(self, name: str) -> Table:
        """The named table (with its columns and no rows when the trace has no such events)."""
        t = self._tables.get(name)
        if t is None:
            path = os.path.join(self.store_dir, f"{name}.parquet") if self.store_dir else None
            if path and os.path.exists(path):
                # ParquetFile, not read_table: read_table's pyarrow.dataset imports pandas (0.4
                # CPU-s in each fresh worker); the table read is the same. No reader threads: a
                # task has one CPU (engines.TASK_CPUS), and on a full host they only contend
                with pq.ParquetFile(path) as pf:
                    t = Table.from_arrow(pf.read(use_threads=False))
            else:
                t = empty_table(name)
            self._tables[name] = t
        return t

    def __getattr__(self, name: str) -> Table:
        if name in TABLES:
            return self.table(name)
        raise AttributeError(name)

    @property
    def world_size(self) -> int:
        return int(self.meta.get("world_size") or 1)

    @property
    def device_name(self) -> str:
        props = self.meta.get("device_properties") or []
        dev = self.meta.get("device")
        for p in props:
            if dev is None or p.get("id") == dev:
                return str(p.get("name", ""))
        return ""

    @property
    def sm_count(self) -> int | None:
        """Streaming multiprocessors of the traced device (Kineto's ``numSms``), None if unknown."""
        props = self.meta.get("device_properties") or []
        dev = self.meta.get("device")
        for p in props:
            if dev is None or p.get("id") == dev:
                n = p.get("numSms")
                return int(n) if isinstance(n, int) and n > 0 else None
        return None


@dataclass
class Capture:
    """All ranks of one capture, ordered by rank."""

    ranks: list[RankTrace]

    @property
    def world_size(self) -> int:
        return max([r.world_size for r in self.ranks] + [len(self.ranks)])

    def rank(self, r: int) -> RankTrace:
        for t in self.ranks:
            if t.rank == r:
                return t
        raise KeyError(r)


def find_trace_files(paths: Iterable[str], capture: Optional[int] = None) -> list[str]:
    """Expand files and directories into the trace files they hold (sorted, deduplicated), one
    capture per rank: of several captures of one worker (torch.profiler's
    ``tensorboard_trace_handler`` cycles) the newest, or the ``capture``-th (1 = the oldest);
    see :func:`select_captures`."""
    found: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            hits = []
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.endswith(".aiprof") and not d.startswith("."))
                for f in files:
                    if f.endswith(_TRACE_SUFFIXES) and f not in _NOT_TRACES and not f.startswith("."):
                        hits.append(os.path.join(root, f))
            if not hits:
                raise TraceError(p, "no trace files (*.json, *.json.gz) in this directory")
            found.extend(sorted(hits))
        elif os.path.exists(p):
            found.append(p)
        elif os.path.islink(p):
            raise TraceError(p, "broken link: the trace it points to has vanished")
        else:
            raise TraceError(p, "no such file or directory")
    seen, out = set(), []
    for f in found:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return select_captures(out, capture)


def tensorboard_name(path: str) -> Optional[tuple[str, int]]:
    """(worker name, time stamp in ns) of a file named by torch.profiler's
    ``tensorboard_trace_handler``, None for any other name."""
    m = _TENSORBOARD_NAME.match(os.path.basename(path))
    return (m.group("worker"), int(m.group("ns"))) if m else None


def _rank_in_path(path: str) -> Optional[int]:
    m = _RANK_IN_NAME.search(os.path.relpath(path))
    return int(m.group(1)) if m else None


def _own_rank(path: str) -> Optional[int]:
    """The rank a trace names itself (distributedInfo in its head, else rank<N> in its path)."""
    head = read_header(path, _PEEK_BYTES) or {}
    dist = head.get("distributedInfo")
    rank = dist.get("rank") if isinstance(dist, dict) else None
    if _is_int(rank, 0, _MAX_RANK):
        return int(rank)
    return _rank_in_path(path)


def select_captures(files: list[str], capture: Optional[int] = None) -> list[str]:
    """One capture per rank: files of one ``tensorboard_trace_handler`` worker that name no
    distinct ranks are successive captures of one process (the profiler's cycles), not ranks.
    Of each such group the newest is kept (``capture``: the N-th, 1 = the oldest), in the place
    of the group's first file; one line on stderr says which, and that the others exist. Files
    of different workers (other pids, hosts) or with their own distinct ranks stay ranks."""
    groups: dict[tuple[str, Optional[int]], list[tuple[int, str]]] = {}
    by_worker: dict[str, list[str]] = {}
    for f in files:
        tb = tensorboard_name(f)
        if tb:
            by_worker.setdefault(tb[0], []).append(f)
    for worker, fs in by_worker.items():
        if len(fs) < 2:
            continue
        for f in fs:  # only here is a file's head read: one worker's files might still be ranks
            groups.setdefault((worker, _own_rank(f)), []).append((tensorboard_name(f)[1], f))
    several = {k: sorted(v) for k, v in groups.items() if len(v) > 1}
    if capture is not None:
        if capture < 1:
            raise UsageError(f"--capture {capture}: captures are numbered from 1 (the oldest)")
        if not several:
            raise UsageError(f"--capture {capture}: no worker here has several captures "
                             "(torch.profiler tensorboard_trace_handler files of one process)")
        for (worker, _), caps in several.items():
            if capture > len(caps):
                raise UsageError(f"--capture {capture}: {worker} has {len(caps)} captures")
    if not several:
        return files
    keep: dict[str, str] = {}  # first file of a group -> the capture kept in its place
    drop: set[str] = set()
    picked: list[str] = []
    for caps in several.values():
        n = len(caps) if capture is None else capture
        chosen = caps[n - 1][1]
        first = min((f for _, f in caps), key=files.index)
        keep[first] = chosen
        drop.update(f for _, f in caps)
        picked.append(f"{os.path.basename(chosen)} ({n} of {len(caps)})")
    which = "the newest" if capture is None else f"capture {capture}"
    print(f"aiprof: note: several captures of one process (torch.profiler cycles), analysing {which}: "
          f"{', '.join(picked)}; --capture N picks another (1 = the oldest)", file=sys.stderr)
    return [keep[f] if f in keep else f for f in files if f in keep or f not in drop]


def fingerprint(path: str) -> dict:
    """What identifies a trace file and its sidecars as read (a changed one is a different input)."""
    st = os.stat(path)
    fp = {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
          "store_version": STORE_VERSION}
    hw = hw_path_for(path)
    if hw:  # samples that appear or change beside the trace invalidate the store too
        hst = os.stat(hw)
        fp["hw"] = {"size": hst.st_size, "mtime_ns": hst.st_mtime_ns}
    pm = pm_path_for(path)
    if pm:
        pst = os.stat(pm)
        fp["pm"] = {"size": pst.st_size, "mtime_ns": pst.st_mtime_ns}
    for name, p in native_paths_for(path).items():  # so do the native sidecar's files
        nst = os.stat(p)
        fp[name] = {"size": nst.st_size, "mtime_ns": nst.st_mtime_ns}
    cm = _capture_meta_path(path)
    if cm:  # so does the agent's meta.json (it holds the unprofiled step times)
        cst = os.stat(cm)
        fp["capture_meta"] = {"size": cst.st_size, "mtime_ns": cst.st_mtime_ns}
    return fp


CAPTURE_META = "meta.json"
CAPTURE_SCHEMA = "aiprof.capture/1"
# What the analysis keeps of the agent's meta.json (the rest is for the service and the user).
_CAPTURE_KEYS = ("capture_id", "origin", "trigger", "mode", "options", "steps", "device", "activities", "native",
                 "stop", "clock", "communication")


def _capture_meta_path(trace_path: str) -> str | None:
    p = os.path.join(os.path.dirname(os.path.abspath(trace_path)), CAPTURE_META)
    return p if os.path.isfile(p) else None


def read_capture_meta(trace_path: str) -> dict:
    """The parts of the agent's ``meta.json`` beside a trace that the analysis uses (notably
    ``steps.before_median_ms``, the unprofiled step time measured just before the capture);
    {} when there is none or it is not an aiprof capture's."""
    p = _capture_meta_path(trace_path)
    if not p:
        return {}
    try:
        with open(p, "rb") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(m, dict) or m.get("schema") != CAPTURE_SCHEMA:
        return {}
    return {k: m[k] for k in _CAPTURE_KEYS if k in m}


def _cache_root() -> Path:
    env = os.environ.get("AIPROF_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aiprof"


def store_dir_for(path: str) -> str:
    """Where the store of ``path`` lives: beside it if writable, else in the cache dir."""
    if not os.environ.get("AIPROF_CACHE_DIR"):
        parent = os.path.dirname(os.path.abspath(path))
        if os.access(parent, os.W_OK):
            return os.path.abspath(path) + ".aiprof"
    digest = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:16]
    return str(_cache_root() / f"{Path(path).name}-{digest}")


def _load_cached(store: str, fp: dict) -> Optional[dict]:
    try:
        with open(os.path.join(store, "meta.json"), "rb") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if meta.get("source") == fp else None


_MAX_RANK = 1 << 24  # no job has 16 M ranks: a larger number is not a rank
_DEVICE_INTS = ("id", "numSms", "totalGlobalMem", "computeMajor", "computeMinor")


def _is_int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:39] + "…"


def _check_meta(path: str, raw: dict) -> None:
    """Refuse top-level metadata of the wrong shape with one line naming the key."""
    dist = raw.get("distributedInfo")
    if dist is not None:
        if not isinstance(dist, dict):
            raise TraceError(path, f'"distributedInfo" is {_short(dist)}, not an object')
        if dist.get("rank") is not None and not _is_int(dist["rank"], 0, _MAX_RANK):
            raise TraceError(path, f'"distributedInfo.rank" is {_short(dist["rank"])}, not a rank number')
        if dist.get("world_size") is not None and not _is_int(dist["world_size"], 1, _MAX_RANK):
            raise TraceError(path, f'"distributedInfo.world_size" is {_short(dist["world_size"])}, not a number of ranks')
    props = raw.get("deviceProperties")
    if props is not None:
        if not isinstance(props, list) or not all(isinstance(p, dict) for p in props):
            raise TraceError(path, f'"deviceProperties" is {_short(props)}, not a list of objects')
        for i, p in enumerate(props):
            for k in _DEVICE_INTS:
                if p.get(k) is not None and not _is_int(p[k], -(2**63), 2**63 - 1):
                    raise TraceError(path, f'"deviceProperties[{i}].{k}" is {_short(p[k])}, not an integer')


def _trace_meta(path: str, raw: dict, tables: dict[str, Table]) -> dict:
    """Normalise the trace's top-level keys into aiprof's metadata. A trace that names no rank
    of its own gets ``rank`` None (``rank_from`` "order"): its number is its place among the
    files opened together (:func:`_with_rank`), which is no property of the file to cache."""
    _check_meta(path, raw)
    exported = raw.get("aiprof") if isinstance(raw.get("aiprof"), dict) else {}
    if len(exported.get("ranks") or []) > 1:  # one Kineto file is one rank: these would merge into one
        raise TraceError(path, f"an `aiprof export` of {len(exported['ranks'])} ranks in one file reads back as "
                               "one rank: analyse the capture it came from, or export each rank (--rank R)")
    dist = raw.get("distributedInfo") or {}
    rank = dist.get("rank")
    rank_from = "distributedInfo"
    if rank is None:
        rank = _rank_in_path(path)
        rank_from = "file name" if rank is not None else "order"
    kernels = tables.get("kernels")
    device = None
    if kernels is not None and len(kernels):
        import numpy as np
        vals, counts = npx.unique(kernels["device"], return_counts=True)
        device = int(vals[np.argmax(counts)])
    extra = {k: v for k, v in raw.items() if k not in ("deviceProperties", "distributedInfo")}
    return {
        "rank": None if rank is None else int(rank),
        "rank_from": rank_from,
        "world_size": int(dist.get("world_size") or 1),
        "distributed": dist,
        "device": device,
        "device_properties": raw.get("deviceProperties") or [],
        "host_name": raw.get("host_name") or "",
        "versions": {k: raw[k] for k in ("schemaVersion", "cuda_runtime_version", "cuda_driver_version",
                                         "cupti_version") if k in raw},
        "options": {k: raw[k] for k in ("with_stack", "record_shapes", "profile_memory", "with_flops")
                    if k in raw},
        "trace": extra,
    }


def ingest(path: str, index: int = 0, progress: Optional[Callable[[int, int], None]] = None,
           use_cache: bool = True) -> RankTrace:
    """Ingest one trace file into its store (or reuse the cache) and return the rank's trace;
    ``index``, the file's place among those opened together, numbers a trace without a rank."""
    try:
        fp = fingerprint(path)
    except FileNotFoundError:
        raise TraceError(path, "no such file (it may have been removed)") from None
    store = store_dir_for(path)
    if use_cache:
        meta = _load_cached(store, fp)
        if meta is not None:
            return _with_rank(RankTrace(rank=-1, source=path, meta=meta, store_dir=store), index)
    t0 = time.perf_counter()
    parsed = read_trace(path, progress=progress)
    hw = hw_path_for(path)
    if hw:
        try:
            parsed.tables["hw"] = read_hw_csv(hw)
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            print(f"aiprof: warning: {hw}: hardware samples skipped ({exc})", file=sys.stderr)
    pm = pm_path_for(path)
    if pm:
        try:
            parsed.tables["pm"] = read_pm_csv(pm)
        except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:  # gzip.BadGzipFile is an OSError
            print(f"aiprof: warning: {pm}: PM samples skipped ({exc})", file=sys.stderr)
    for name, p in native_paths_for(path).items():
        try:
            parsed.tables[name] = read_native(p, name)
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            print(f"aiprof: warning: {p}: native {name} skipped ({exc})", file=sys.stderr)
    capture = read_capture_meta(path)
    end = capture_end_ns(capture)
    clipped = clip_after(parsed.tables, end) if end is not None else 0
    meta = _trace_meta(path, parsed.meta, parsed.tables)
    meta["capture"] = capture
    meta["rows_after_capture_end"] = clipped  # dropped: the job's next step (trace/clip.py)
    meta["source"] = fp
    meta["rows"] = {name: len(t) for name, t in parsed.tables.items()}
    meta["events"] = parsed.n_events
    meta["ingest_workers"] = parsed.workers
    meta["ingest_s"] = round(time.perf_counter() - t0, 3)
    rt = RankTrace(rank=-1, source=path, meta=meta, _tables=dict(parsed.tables))
    try:
        rt.store_dir = _write_store(store, parsed.tables, meta)
    except OSError as exc:  # a read-only cache is no reason to fail the analysis
        print(f"aiprof: warning: could not write the store for {path} ({exc}); continuing without cache",
              file=sys.stderr)
    return _with_rank(rt, index)


def _with_rank(rt: RankTrace, index: int) -> RankTrace:
    """Number a trace that names no rank by its place among the files opened together (``index``).
    Stores written by earlier aiprof versions hold such a number, with ``rank_from`` "order", as
    if it were the trace's own: it is re-derived too. The meta is copied: the store keeps None."""
    if rt.meta.get("rank") is None or rt.meta.get("rank_from") == "order":
        rt.meta = {**rt.meta, "rank": index, "rank_from": "order"}
    rt.rank = int(rt.meta["rank"])
    return rt


def _write_store(store: str, tables: dict[str, Table], meta: dict) -> str:
    parent = os.path.dirname(store) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        for name, t in tables.items():
            at = t.to_arrow()
            # Parquet dictionary-encodes only the string columns (dictionaries already): tried on
            # every numeric column too, it doubled the write and made the file larger; and no column
            # statistics, which no read uses (each reads whole columns). docs/scale.md
            strings = [f.name for f in at.schema if pa.types.is_dictionary(f.type)]
            pq.write_table(at, os.path.join(tmp, f"{name}.parquet"), compression="lz4", use_dictionary=strings,
                           write_statistics=False)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        if os.path.exists(store):
            shutil.rmtree(store, ignore_errors=True)
        os.replace(tmp, store)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return store


def json_bytes(path: str) -> int:
    """How much JSON a trace file holds, which is what ingest time follows: the file's size, or for
    a .gz its ISIZE trailer (the last 4 bytes: the uncompressed length mod 2**32, read without
    decompressing). The modulus makes a trace of over 4 GiB read as less, and a multi-member gzip
    gives its last member's length; the larger of that and the file's size is kept, so a wrong
    trailer never makes a file count as smaller than it is on disk."""
    size = os.path.getsize(path)
    if not path.endswith(".gz") or size < 18:  # 10-byte header + 8-byte trailer
        return size
    try:
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
    except OSError:
        return size
    return max(size, isize)


def progress_wanted(files: list[str]) -> bool:
    """Whether to draw progress on stderr: $AIPROF_PROGRESS=always|never, else when stderr is a
    terminal and the traces hold more than PROGRESS_MIN_BYTES of JSON."""
    mode = os.environ.get("AIPROF_PROGRESS", "auto")
    if mode in ("always", "never"):
        return mode == "always"
    return sys.stderr.isatty() and sum(json_bytes(f) for f in files) > PROGRESS_MIN_BYTES


def open_capture(paths: Iterable[str] | str, use_cache: bool = True, show_progress: Optional[bool] = None,
                 capture: Optional[int] = None) -> Capture:
    """Open trace files and/or capture directories as one :class:`Capture` (of several captures
    of one process, the newest or the ``capture``-th: :func:`find_trace_files`).

    A progress bar is shown on stderr for large inputs (by JSON size: :func:`progress_wanted`)
    (``show_progress`` forces it on or off; so does $AIPROF_PROGRESS=always|never).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [str(paths)]
    files = find_trace_files(paths, capture)
    total = sum(os.path.getsize(f) for f in files)  # the bar counts bytes read from disk
    if show_progress is None:
        show_progress = progress_wanted(files)
    ranks: list[RankTrace] = []
    if show_progress:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        from aiprof.termtext import markup_safe

        # on stderr: stdout may be the JSON report, piped elsewhere
        with Progress(TextColumn("[bold]ingest[/] {task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("", total=total)
            done = 0
            for i, f in enumerate(files):
                bar.update(task, description=markup_safe(os.path.basename(f)))  # the column parses markup
                ranks.append(ingest(f, i, lambda n, _t, d=done: bar.update(task, completed=d + n), use_cache))
                done += os.path.getsize(f)
    else:
        ranks = [ingest(f, i, None, use_cache) for i, f in enumerate(files)]
    by_rank: dict[int, RankTrace] = {}
    for r in ranks:
        if r.rank in by_rank:
            raise TraceError(r.source, f"rank {r.rank} appears twice (also in {by_rank[r.rank].source})")
        by_rank[r.rank] = r
    return Capture(ranks=[by_rank[k] for k in sorted(by_rank)])
