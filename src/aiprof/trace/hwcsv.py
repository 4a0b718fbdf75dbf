"""Reader for the agent's hardware samples (``hw.csv`` beside a rank's ``trace.json.gz``).

Long format, one value per row: ``ts_us,device,metric,value`` with ``ts_us`` already on the
trace's clock (the agent shifts it; docs/capture.md). Ingested into the store's ``hw`` table
(ts ns, device, metric, name = "device metric", value) so every analysis, the UI and the exports
read samples from the store like any other table.
"""
from __future__ import annotations

import csv
import math
import os

import numpy as np

from aiprof.trace.table import Table, encode_strings

HW_FILE = "hw.csv"
PM_FILE = "pm.csv.gz"
_TS_MAX_US = 2.0**62 / 1000.0  # times are int64 ns (as in trace.builder)


def hw_path_for(trace_path: str) -> str | None:
    """The ``hw.csv`` that sits beside a trace file, if any."""
    p = os.path.join(os.path.dirname(os.path.abspath(trace_path)), HW_FILE)
    return p if os.path.isfile(p) else None


def read_hw_csv(path: str) -> Table:
    """Read samples sorted by time; malformed rows (a torn last line) are skipped."""
    ts, dev, met, val = [], [], [], []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            try:
                t, v = float(rec["ts_us"]), float(rec["value"])
            except (KeyError, TypeError, ValueError):
                continue
            if not math.isfinite(t) or abs(t) > _TS_MAX_US:
                continue  # not a time on the trace's clock (a NaN value is a real sample: kept)
            ts.append(t)
            val.append(v)
            dev.append(rec.get("device") or "")
            met.append(rec.get("metric") or "")
    return hw_table(ts, dev, met, val)


def hw_table(ts: list[float], dev: list[str], met: list[str], val: list[float]) -> Table:
    """The ``hw`` table from samples (ts in µs), sorted by time."""
    order = np.argsort(np.asarray(ts, dtype=np.float64), kind="stable")
    tns = np.rint(np.asarray(ts, dtype=np.float64) * 1000.0).astype(np.int64)[order]
    dev = [dev[i] for i in order]
    met = [met[i] for i in order]
    return Table({
        "ts": tns,
        "device": encode_strings(dev),
        "metric": encode_strings(met),
        "name": encode_strings([f"{d} {m}".strip() for d, m in zip(dev, met)]),
        "value": np.asarray(val, dtype=np.float64)[order],
    })


def pm_path_for(trace_path: str) -> str | None:
    """The ``pm.csv.gz`` (CUPTI PM samples) beside a trace file, if any."""
    p = os.path.join(os.path.dirname(os.path.abspath(trace_path)), PM_FILE)
    return p if os.path.isfile(p) else None


def read_pm_csv(path: str) -> Table:
    """Read the agent's PM samples (wide: ``t0_us,t1_us,device,<column>...``, gzipped, trace
    clock) into the long ``pm`` table: one row per sample and column, with the sample's window.
    Malformed rows (a torn last line) are skipped."""
    import gzip

    t0, t1, dev, met, val = [], [], [], [], []
    with gzip.open(path, "rt", newline="") as f:
        rd = csv.reader(f)
        head = next(rd, None)
        if not head or head[:3] != ["t0_us", "t1_us", "device"]:
            raise csv.Error("not a PM sample file (header t0_us,t1_us,device,...)")
        cols = head[3:]
        for rec in rd:
            if len(rec) != len(head):
                continue
            try:
                a, b = float(rec[0]), float(rec[1])
                vs = [float(x) for x in rec[3:]]
            except ValueError:
                continue
            if not (math.isfinite(a) and math.isfinite(b)) or abs(a) > _TS_MAX_US or abs(b) > _TS_MAX_US or b < a:
                continue
            for c, v in zip(cols, vs):
                t0.append(a)
                t1.append(b)
                dev.append(rec[2])
                met.append(c)
                val.append(v)
    return pm_table(t0, t1, dev, met, val)


def pm_table(t0: list[float], t1: list[float], dev: list[str], met: list[str], val: list[float]) -> Table:
    """The ``pm`` table (t0/t1 ns on the trace clock, device, metric, value), sorted by t0."""
    a = np.asarray(t0, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    return Table({
        "t0": np.rint(a * 1000.0).astype(np.int64)[order],
        "t1": np.rint(np.asarray(t1, dtype=np.float64) * 1000.0).astype(np.int64)[order],
        "device": encode_strings([dev[i] for i in order]),
        "metric": encode_strings([met[i] for i in order]),
        "value": np.asarray(val, dtype=np.float64)[order],
    })
