"""NVML is not read while the PM counters sample (agent/hwmon.py): what reads its series must not
take the last value before that stretch for the stretch itself. The SM clock comes from PM's GPC
clock where PM sampled it; a chart's NVML series gets a gap over the unsampled stretch."""
from __future__ import annotations

import csv
import gzip
import shutil
from pathlib import Path

import numpy as np

from aiprof.analysis import rankdiff, timeseries
from aiprof.analysis.steps import find_steps
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data"


def test_the_sm_clock_comes_from_the_pm_counters_inside_the_steps(tmp_path):
    d = tmp_path / "cap"
    shutil.copytree(DATA / "pm_lead_h100", d)  # the analysis caches next to the trace: not in the repo
    rt = open_capture(str(d)).ranks[0]
    steps = find_steps(rt)
    assert len(steps)
    # independently, from the file: the GPC clock of the samples inside the steps, on the trace clock
    with gzip.open(next(d.rglob("pm.csv.gz")), "rt") as f:
        rows = [r for r in csv.DictReader(f)
                if float(r["t0_us"]) * 1e3 >= steps.start.min() and float(r["t1_us"]) * 1e3 <= steps.end.max()]
    assert rows
    want = float(np.median([float(r["pm_gpc_clock_hz"]) for r in rows])) / 1e6
    assert abs(rankdiff.sm_clock_mhz(rt) - want) < 1.0  # MHz (the store keeps ns; the file µs)


def test_a_chart_series_has_a_gap_where_nothing_was_sampled():
    ts = np.array([0, 100, 200, 300, 5_000, 5_100, 5_200], dtype=np.int64)  # a 4.7 unit stretch unsampled
    v = np.array([10.0, 11, 12, 13, 50, 51, 52])
    t, out = timeseries.with_gaps(ts, v)
    assert out == [10.0, 11, 12, 13, None, 50, 51, 52]
    assert t[4] == 301 and t[5] == 5_000
    evenly = timeseries.with_gaps(ts[:4], v[:4])
    assert None not in evenly[1] and evenly[0] == ts[:4].tolist()
