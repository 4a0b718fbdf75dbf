"""Ending a capture off the training thread (agent/offstop.py), with real jobs under aiprof run.

The training thread only detaches the profiler; the export thread finishes it (Kineto's
post-processing) and writes the trace. What the tests hold, without timing: the stopper builds
here, a capture ends detached and is complete, the store drops what was recorded after the
detach, and every way the stopper can be missing falls back to torch's own stop."""
from __future__ import annotations

import os

import numpy as np
from capsupport import PY, SCRIPTS, aiprof, env_with, load_meta, load_trace, profiler_steps, rank_dirs

from aiprof.agent import offstop
from aiprof.trace.clip import capture_end_ns
from aiprof.trace.store import open_capture

GATED = SCRIPTS / "gated_train.py"


def test_the_stopper_builds_and_loads_against_this_torch():
    path = offstop.build()  # tests/conftest.py built it already: this is the cached copy
    assert os.path.isfile(path)
    offstop.prepare()  # built: loads at once, on this thread
    assert offstop.ready() is not None, offstop.unavailable()


def test_a_capture_ends_detached_and_the_store_drops_what_came_after(rt, tmp_path):
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--skip", "2", "--iterations", "3", "--what", "kernels,python", "--out", str(out),
                 "--capture-id", "c", "--", PY, str(GATED), "--steps", "30")
    assert res.returncode == 0, res.stderr[-3000:]
    (d,) = rank_dirs(out, "c")
    meta = load_meta(d)
    assert meta["stop"]["how"] == "detached", meta["stop"]
    assert meta["export"]["how"] == "offthread" and meta["export"]["finish_ms"] > 0, meta["export"]
    assert meta["export"]["stop_ms"] < meta["export"]["finish_ms"]  # the training thread's part is the small one
    trace = load_trace(d)
    assert profiler_steps(trace) == [2, 3, 4]
    cap = open_capture(str(d), use_cache=False)
    (r,) = cap.ranks
    end = capture_end_ns(r.meta["capture"])
    assert end is not None
    for name in ("ops", "python", "annotations"):
        t = r.table(name)
        assert not len(t) or (t["ts"] <= end).all(), name
    # the ProfilerStep annotations are all before the end; the detach came after the last one ended
    steps = r.table("annotations")
    names = steps.strings("name").values()
    last = np.flatnonzero(names == "ProfilerStep#4")[0]
    slack_ns = 1000 * meta["clock"]["uncertainty_us"] + 1_000_000  # the clock mapping's own error, and a ms
    assert steps["ts"][last] + steps["dur"][last] <= end + slack_ns


def test_without_the_stopper_the_capture_stops_the_old_way(rt, tmp_path):
    """A compiler that fails and an empty cache: the stopper cannot be built; the capture stops
    on the training thread (torch's stop_trace), is complete, and meta.json says why."""
    out = tmp_path / "caps"
    env = env_with(rt, CXX="false", XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = aiprof(rt, "run", "--skip", "2", "--iterations", "2", "--out", str(out), "--capture-id", "c", "--",
                 PY, str(GATED), "--steps", "12", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    (d,) = rank_dirs(out, "c")
    meta = load_meta(d)
    assert meta["stop"]["how"] == "stop_trace", meta["stop"]
    assert meta["stop"]["why"] in ("the stopper was still building",) or "profiler stopper" in meta["stop"]["why"]
    assert meta["export"]["how"] in ("thread", "fork") and profiler_steps(load_trace(d)) == [2, 3]


def test_offstop_0_keeps_torchs_own_stop(rt, tmp_path):
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--skip", "2", "--iterations", "2", "--out", str(out), "--capture-id", "c", "--",
                 PY, str(GATED), "--steps", "12", env=env_with(rt, AIPROF_OFFSTOP="0"))
    assert res.returncode == 0, res.stderr[-3000:]
    (d,) = rank_dirs(out, "c")
    meta = load_meta(d)
    assert meta["stop"] == {"how": "stop_trace", "why": "AIPROF_OFFSTOP=0"}
    assert profiler_steps(load_trace(d)) == [2, 3]


def test_clock_marker_keeps_the_tightest_bracket(monkeypatch):
    """A thread preempted between the marker's two clock reads widens that bracket: the marker is
    retaken (named #k) and the tightest kept, stopping at a good one."""
    from contextlib import contextmanager

    from aiprof.agent import capture

    reads = iter([0, 7_000_000, 10_000_000, 10_900_000, 20_000_000, 20_010_000, 30_000_000, 30_000_001])
    monkeypatch.setattr(capture.time, "time_ns", lambda: next(reads))
    names = []

    @contextmanager
    def record_function(name):
        names.append(name)
        yield

    got = capture.clock_marker(record_function)
    # brackets 7 ms, 0.9 ms, then 10 µs (good: stop there)
    assert names == ["aiprof::clock_sync#0", "aiprof::clock_sync#1", "aiprof::clock_sync#2"]
    assert got == {"marker_unix_ns": [20_000_000, 20_010_000], "marker_name": "aiprof::clock_sync#2"}


def test_trace_offset_takes_the_base_the_marker_confirms():
    """Kineto's ts are µs since the trace's baseTimeNanoseconds: inside the marker's bracket, the
    base is the offset (the marker's midpoint is off by up to half its bracket); far outside it
    (the trace on another clock), the marker's own offset is kept."""
    from aiprof.agent.capture import CLOCK_BASE_SLACK_US, trace_offset

    base_ns = 1_790_857_026_000_000_000
    # a bracket of 8 ms (a preempted thread); the event was stamped 0.5 ms after the first read
    t0 = base_ns + 5_000_000_000
    ts = (t0 + 500_000) / 1000 - base_ns / 1000
    got = trace_offset(ts, [t0, t0 + 8_000_000], "m#0", base_ns)
    assert got["trace_minus_unix_us"] == -base_ns / 1000 and "baseTimeNanoseconds" in got["method"]
    assert got["marker_offset_us"] == -base_ns / 1000 - 3500 and got["uncertainty_us"] == 4000
    # a trace whose events are not on Unix time: the base is ignored
    far = trace_offset(ts + 10 * CLOCK_BASE_SLACK_US + 4000, [t0, t0 + 8_000_000], "m#0", base_ns)
    assert far["trace_minus_unix_us"] == -base_ns / 1000 - 3500 + 10 * CLOCK_BASE_SLACK_US + 4000
    assert far["method"].startswith("record_function 'm#0'") and far["base_time_ns"] == base_ns
    # no base in the trace: the marker's
    assert trace_offset(ts, [t0, t0 + 8_000_000], "m#0", None)["trace_minus_unix_us"] == -base_ns / 1000 - 3500
