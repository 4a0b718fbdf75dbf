"""Rows recorded after a capture's end are dropped (trace/clip.py), on a real H200 trace: the
GPT-2 stall capture cut at a moment inside its steps, as if the profiler had been detached there."""
from __future__ import annotations

import numpy as np

from aiprof.trace.clip import HOST_TABLES, capture_end_ns, clip_after
from aiprof.trace.kineto import read_trace


def test_clip_after_drops_host_rows_and_the_gpu_work_they_launched(gpt2_stall):
    tables = read_trace(str(gpt2_stall)).tables
    rt, k = tables["runtime"], tables["kernels"]
    # the end: the launch of the kernel in the middle of the trace, the moment of a detach
    mid = len(k) // 2
    launch = np.flatnonzero(rt["corr"] == k["corr"][mid])[0]
    end = int(rt["ts"][launch])
    late_corr = set(rt["corr"][rt["ts"] > end].tolist())
    kept_kernels = k["corr"][~np.isin(k["corr"], list(late_corr))]
    before = {n: len(t) for n, t in tables.items()}
    expect_host = {n: int((tables[n]["ts"] <= end).sum()) for n in HOST_TABLES if n in tables and len(tables[n])}

    dropped = clip_after(tables, end)

    for n, rows in expect_host.items():
        assert len(tables[n]) == rows and (tables[n]["ts"] <= end).all(), n
    assert np.array_equal(tables["kernels"]["corr"], kept_kernels)
    # a kernel launched before the end stays though it ran after it (the GPU was behind the host)
    assert k["corr"][mid] in set(tables["kernels"]["corr"].tolist())
    assert (tables["kernels"]["ts"] > end).any()
    assert not (set(tables["kernels"]["corr"].tolist()) & late_corr)
    assert (tables["flows"]["src_ts"] <= end).all()
    assert dropped == sum(before[n] - len(t) for n, t in tables.items()) > 0


def test_capture_end_comes_only_from_a_detached_stop():
    clock = {"trace_minus_unix_us": -1.5e15}
    assert capture_end_ns({"stop": {"how": "detached", "detached_unix_ns": 2_000_000_000_000_000_000},
                           "clock": clock}) == 2_000_000_000_000_000_000 - 1_500_000_000_000_000_000
    assert capture_end_ns({"stop": {"how": "stop_trace", "why": "x"}, "clock": clock}) is None
    assert capture_end_ns({"stop": {"detached_unix_ns": 5}, "clock": {}}) is None
    assert capture_end_ns({}) is None
