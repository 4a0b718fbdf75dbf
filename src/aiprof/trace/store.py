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

import pyarrow.parquet as pq

from aiprof import npx
from aiprof.errors import TraceError
from aiprof.trace.builder import empty_table
from aiprof.trace.clip import capture_end_ns, clip_after
from aiprof.trace.hwcsv import hw_path_for, pm_path_for, read_hw_csv, read_pm_csv
from aiprof.trace.nativecsv import native_paths_for, read_native
from aiprof.trace.kineto import TABLES, read_trace
from aiprof.trace.table import Table

STORE_VERSION = 5  # bump when ingest output changes: old stores are re-ingested (3: validated times, clamped
# durations; 4: the agent's meta.json beside the trace, for the unprofiled step time; 5: pm, calls, syscalls)
_TRACE_SUFFIXES = (".json", ".json.gz")
_NOT_TRACES = {"meta.json", "report.json"}
PROGRESS_MIN_BYTES = 32 << 20  # smaller inputs ingest in about a second: no bar
_RANK_IN_NAME = re.compile(r"rank[_\-]?(\d+)", re.IGNORECASE)


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
                t = Table.from_arrow(pq.read_table(path))
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


def find_trace_files(paths: Iterable[str]) -> list[str]:
    """Expand files and directories into the trace files they hold (sorted, deduplicated)."""
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
    return out


def _fingerprint(path: str) -> dict:
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
                 "stop", "clock")


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


def _trace_meta(path: str, raw: dict, tables: dict[str, Table], index: int) -> dict:
    """Normalise the trace's top-level keys into aiprof's metadata."""
    _check_meta(path, raw)
    dist = raw.get("distributedInfo") or {}
    rank = dist.get("rank")
    rank_from = "distributedInfo"
    if rank is None:
        m = _RANK_IN_NAME.search(os.path.relpath(path))
        rank, rank_from = (int(m.group(1)), "file name") if m else (index, "order")
    kernels = tables.get("kernels")
    device = None
    if kernels is not None and len(kernels):
        import numpy as np
        vals, counts = npx.unique(kernels["device"], return_counts=True)
        device = int(vals[np.argmax(counts)])
    extra = {k: v for k, v in raw.items() if k not in ("deviceProperties", "distributedInfo")}
    return {
        "rank": int(rank),
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
    """Ingest one trace file into its store (or reuse the cache) and return the rank's trace."""
    try:
        fp = _fingerprint(path)
    except FileNotFoundError:
        raise TraceError(path, "no such file (it may have been removed)") from None
    store = store_dir_for(path)
    if use_cache:
        meta = _load_cached(store, fp)
        if meta is not None:
            return RankTrace(rank=meta["rank"], source=path, meta=meta, store_dir=store)
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
    meta = _trace_meta(path, parsed.meta, parsed.tables, index)
    meta["capture"] = capture
    meta["rows_after_capture_end"] = clipped  # dropped: the job's next step (trace/clip.py)
    meta["source"] = fp
    meta["rows"] = {name: len(t) for name, t in parsed.tables.items()}
    meta["events"] = parsed.n_events
    meta["ingest_workers"] = parsed.workers
    meta["ingest_s"] = round(time.perf_counter() - t0, 3)
    rt = RankTrace(rank=meta["rank"], source=path, meta=meta, _tables=dict(parsed.tables))
    try:
        rt.store_dir = _write_store(store, parsed.tables, meta)
    except OSError as exc:  # a read-only cache is no reason to fail the analysis
        print(f"aiprof: warning: could not write the store for {path} ({exc}); continuing without cache",
              file=sys.stderr)
    return rt


def _write_store(store: str, tables: dict[str, Table], meta: dict) -> str:
    parent = os.path.dirname(store) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        for name, t in tables.items():
            pq.write_table(t.to_arrow(), os.path.join(tmp, f"{name}.parquet"), compression="lz4")
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        if os.path.exists(store):
            shutil.rmtree(store, ignore_errors=True)
        os.replace(tmp, store)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return store


def open_capture(paths: Iterable[str] | str, use_cache: bool = True, show_progress: Optional[bool] = None) -> Capture:
    """Open trace files and/or capture directories as one :class:`Capture`.

    A progress bar is shown on stderr for large inputs when stderr is a terminal
    (``show_progress`` forces it on or off; so does $AIPROF_PROGRESS=always|never).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [str(paths)]
    files = find_trace_files(paths)
    total = sum(os.path.getsize(f) for f in files)
    if show_progress is None:
        mode = os.environ.get("AIPROF_PROGRESS", "auto")
        show_progress = mode == "always" or (mode == "auto" and sys.stderr.isatty() and total > PROGRESS_MIN_BYTES)
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

        # on stderr: stdout may be the JSON report, piped elsewhere
        with Progress(TextColumn("[bold]ingest[/] {task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("", total=total)
            done = 0
            for i, f in enumerate(files):
                bar.update(task, description=os.path.basename(f))
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
