"""Readers for the native sidecar's files beside a rank's trace (docs/capture.md, "Native data").

* ``calls.csv`` (library calls traced from a probe file) -> the ``calls`` table:
  ts/dur ns, tid, thread, lib, name (the symbol), ret, args (JSON text of the named arguments)
  and the arguments most analyses join on: bytes, count, comm, stream (-1 / "" when absent).
* ``syscalls.csv`` (sampled blocked system calls) -> the ``syscalls`` table: ts/dur ns, tid,
  thread, name (the system call), cls (io | lock | poll | sleep | driver | memory | process |
  other), samples, fd, path.

Times are already on the trace clock (the sidecar shifted them). Malformed rows are skipped.
"""
from __future__ import annotations

import csv
import json
import math
import os

import numpy as np

from aiprof.trace.table import Table, encode_strings

CALLS_FILE = "calls.csv"
SYSCALLS_FILE = "syscalls.csv"
NATIVE_FILES = (CALLS_FILE, SYSCALLS_FILE)
_TS_MAX_US = 2.0**62 / 1000.0


def native_paths_for(trace_path: str) -> dict[str, str]:
    """{"calls": path, "syscalls": path} for the native files beside a trace (those present)."""
    d = os.path.dirname(os.path.abspath(trace_path))
    out = {}
    for name, f in (("calls", CALLS_FILE), ("syscalls", SYSCALLS_FILE)):
        p = os.path.join(d, f)
        if os.path.isfile(p):
            out[name] = p
    return out


def _int(v: object, default: int = -1) -> int:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _times(rec: dict) -> tuple[float, float] | None:
    try:
        t, d = float(rec["ts_us"]), float(rec["dur_us"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (math.isfinite(t) and math.isfinite(d)) or abs(t) > _TS_MAX_US or d < 0 or d > _TS_MAX_US:
        return None
    return t, d


def calls_table(rows: list[dict]) -> Table:
    """The ``calls`` table from calls.csv rows (dicts of strings), sorted by time."""
    ts, dur, tid, ret, nbytes, count = [], [], [], [], [], []
    thread, lib, name, args, comm, stream = [], [], [], [], [], []
    for rec in rows:
        tt = _times(rec)
        if tt is None:
            continue
        try:
            a = json.loads(rec.get("args") or "{}")
        except ValueError:
            a = {}
        if not isinstance(a, dict):
            a = {}
        ts.append(tt[0])
        dur.append(tt[1])
        tid.append(_int(rec.get("tid")))
        ret.append(_int(rec.get("ret"), 0))
        nbytes.append(_int(a.get("bytes")))
        count.append(_int(a.get("count")))
        thread.append(rec.get("thread") or "")
        lib.append(rec.get("lib") or "")
        name.append(rec.get("symbol") or "")
        args.append(rec.get("args") or "{}")
        comm.append(str(a.get("comm") or ""))
        stream.append(str(a.get("stream") or ""))
    return _sorted_table(ts, dur, {"tid": tid, "ret": ret, "bytes": nbytes, "count": count},
                         {"thread": thread, "lib": lib, "name": name, "args": args, "comm": comm, "stream": stream})


def syscalls_table(rows: list[dict]) -> Table:
    """The ``syscalls`` table from syscalls.csv rows, sorted by time."""
    ts, dur, tid, samples, fd = [], [], [], [], []
    thread, name, cls, path = [], [], [], []
    for rec in rows:
        tt = _times(rec)
        if tt is None:
            continue
        ts.append(tt[0])
        dur.append(tt[1])
        tid.append(_int(rec.get("tid")))
        samples.append(_int(rec.get("samples"), 0))
        fd.append(_int(rec.get("fd")))
        thread.append(rec.get("thread") or "")
        name.append(rec.get("syscall") or "")
        cls.append(rec.get("class") or "other")
        path.append(rec.get("path") or "")
    return _sorted_table(ts, dur, {"tid": tid, "samples": samples, "fd": fd},
                         {"thread": thread, "name": name, "cls": cls, "path": path})


def _sorted_table(ts: list, dur: list, ints: dict[str, list], texts: dict[str, list[str]]) -> Table:
    """A table sorted by time: ts and dur (µs in, int64 ns out), int64 and string columns."""
    order = np.argsort(np.asarray(ts, dtype=np.float64), kind="stable")

    def num(v: list, dt: type) -> np.ndarray:
        return np.asarray(v, dtype=dt)[order] if len(v) else np.zeros(0, dt)

    cols = {"ts": np.rint(num(ts, np.float64) * 1000.0).astype(np.int64),
            "dur": np.rint(num(dur, np.float64) * 1000.0).astype(np.int64)}
    cols.update({k: num(v, np.int64) for k, v in ints.items()})
    cols.update({k: encode_strings([v[i] for i in order]) for k, v in texts.items()})
    return Table(cols)


def read_native(path: str, which: str) -> Table:
    """Read calls.csv (``which="calls"``) or syscalls.csv (``"syscalls"``)."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.DictReader(f))
    return calls_table(rows) if which == "calls" else syscalls_table(rows)
