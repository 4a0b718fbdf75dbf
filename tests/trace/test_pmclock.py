"""PM samples onto the trace clock, on samples recorded on an H100 (tests/data/pm, README there)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from aiprof.trace.pmclock import (
    MAX_LAG_US,
    alignment_check,
    cupti_to_trace_us,
    cupti_to_unix_ns,
    drift_ppm,
    map_batches,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "pm" / "pm_phases_h100.json.gz"


@pytest.fixture(scope="module")
def rec() -> dict:
    with gzip.open(DATA, "rt") as f:
        return json.load(f)


def _mapped(rec: dict):
    t0 = np.array(rec["t0"], dtype=np.uint64)
    t1 = np.array(rec["t1"], dtype=np.uint64)
    u0, u1, keep, mp = map_batches(t0, t1, rec["batches"], rec["clock"])
    mu = rec["marker_unix_ns"]
    off = rec["marker_ts_us"] - (mu[0] + mu[1]) / 2000.0
    return u0 / 1000.0 + off, u1 / 1000.0 + off, keep, mp


def test_recorded_samples_map_to_a_regular_100us_grid(rec):
    a, b, keep, mp = _mapped(rec)
    # the first three decode batches were read before Kineto registered its timestamp callback;
    # right after the switch CUPTI handed out samples with zero times: those fail the decode-lag
    # test (zero end) or the window test (zero start only)
    t0, t1 = np.array(rec["t0"]), np.array(rec["t1"])
    old = rec["batches"][2]["row_end"]
    assert mp.dropped == old + int((t1[old:] == 0).sum())
    assert mp.invalid == int(((t0 == 0) & (t1 != 0)).sum()) == 1
    assert mp.kept + mp.dropped + mp.invalid == len(t0)
    # Kineto's callback counts TSC ticks (2.1 per ns on that host)
    assert mp.slope == pytest.approx(1 / 2.1, rel=1e-3)
    gaps = np.diff(a[keep])
    assert np.median(gaps) == pytest.approx(100.0, rel=0.005)
    assert np.percentile(gaps, 99) < 101.0 and gaps.min() > 99.0
    # every kept sample lies within the recorded run (kernels start after sampling started)
    ks = np.array([k["ts"] for k in rec["kernels"]])
    assert a[keep][0] < ks.min() and b[keep][-1] > ks.max()


def test_alignment_check_on_recorded_phases_and_planted_shifts(rec):
    a, b, keep, _ = _mapped(rec)
    a, b = a[keep], b[keep]
    act = np.array(rec["values"])[keep][:, rec["columns"].index("pm_sm_active_pct")]
    ks = [k for k in rec["kernels"] if k["cat"] == "kernel"]
    st = np.array([k["ts"] for k in ks])
    en = st + np.array([k["dur"] for k in ks])
    chk = alignment_check(a, b, act, st, en)
    assert chk.correlation > 0.95
    assert abs(chk.lag_us) <= 200.0  # within two samples after the clock mapping alone
    step = np.median(np.diff(a)) / 4
    for shift in (-1500.0, 800.0, 3000.0):
        moved = alignment_check(a + shift, b + shift, act, st, en)
        assert moved.lag_us == pytest.approx(chk.lag_us + shift, abs=step)
    far = alignment_check(a + 2 * MAX_LAG_US, b + 2 * MAX_LAG_US, act, st, en)
    assert far.lag_us is None or abs(far.lag_us) <= MAX_LAG_US


def test_alignment_check_says_why_when_it_cannot_tell():
    t0 = np.arange(0, 100_000, 100.0)
    flat = alignment_check(t0, t0 + 100, np.full(len(t0), 50.0), np.array([0.0]), np.array([200_000.0]))
    assert flat.lag_us is None and "edges" in flat.why
    few = alignment_check(t0[:10], t0[:10] + 100, np.ones(10), np.array([0.0]), np.array([50.0]))
    assert few.lag_us is None and "samples" in few.why


def test_line_through_two_pairs_absorbs_drift():
    pairs = [{"cupti_ns": 1000, "unix_ns": 5_000_000_000}, {"cupti_ns": 2_100_001_000, "unix_ns": 6_000_000_000}]
    u = cupti_to_unix_ns(np.array([1000.0, 1_050_001_000.0, 2_100_001_000.0]), pairs)
    assert u.tolist() == pytest.approx([5e9, 5.5e9, 6e9])
    assert drift_ppm(pairs) == pytest.approx(1.1e6)
    assert cupti_to_trace_us(np.array([1000.0]), pairs, -4_000_000.0)[0] == pytest.approx(1_000_000.0)
    one = [{"cupti_ns": 10, "unix_ns": 110}]
    assert cupti_to_unix_ns(np.array([20.0]), one)[0] == 120.0 and drift_ppm(one) is None


def test_map_batches_needs_two_pairs_of_one_domain():
    t = np.array([100, 200], dtype=np.uint64)
    with pytest.raises(ValueError):
        map_batches(t, t + 100, [], [{"cupti_ns": 10, "unix_ns": 10}])
    # a switch between the only two pairs (time runs backwards): no domain to map into
    with pytest.raises(ValueError):
        map_batches(t, t + 100, [], [{"cupti_ns": 10**18, "unix_ns": 10**18}, {"cupti_ns": 5, "unix_ns": 10**18 + 5}])
