"""NCCL calls from the default probe file joined to their kernels, on a real capture: rank 1 of a
2-rank DDP GPT-2 on two NVLink H200s, `aiprof attach --probe-file default` (bench/x2_diag.sh).
Its probe clock was mapped 61-89 µs ahead of Kineto's (every launch recorded after its call's
start, most past the call's end): the join must still pair every call with its own kernel."""
from __future__ import annotations

import json

import numpy as np

from aiprof.analysis.native import native_analysis
from aiprof.trace.store import open_capture
from tests.conftest import DATA

CAP = DATA / "native_ddp2_h200"


def test_every_allreduce_joins_its_kernel_and_the_sizes_agree():
    rt = open_capture(str(CAP)).ranks[0]
    out = native_analysis(rt)
    m = out.sizes_match
    # 5 steps x 13 DDP buckets, each joined to its kernel, sizes equal to the kernel's and torch's
    assert m == {"compared": 65, "equal": 65, "op_compared": 65, "op_equal": 65, "joined": 65, "calls": 65}
    colls = out.collectives
    assert {c.join for c in colls} == {"launch"}
    # bucket sizes: 12 x 28,351,488 B and one 157,541,376 B (the tied embedding) per step
    sizes = sorted({c.bytes for c in colls})
    assert sizes == [28_351_488, 157_541_376]
    # every call has its kernel's GPU time, and the big bucket's kernel is the longest
    assert all(c.gpu_us and c.gpu_us > 0 for c in colls)
    big = [c.gpu_us for c in colls if c.bytes == 157_541_376]
    assert min(big) > np.median([c.gpu_us for c in colls if c.bytes == 28_351_488])


def test_calls_per_step_equal_the_buckets():
    rt = open_capture(str(CAP)).ranks[0]
    calls = rt.table("calls")
    names = np.array(calls.strings("name").values())
    ts = calls["ts"][names == "ncclAllReduce"]
    meta = json.loads((CAP / "rank1" / "meta.json").read_text())
    assert meta.get("rank", 1) == 1
    from aiprof.analysis.steps import find_steps

    steps = find_steps(rt)
    per = [int(((ts >= a) & (ts < b)).sum()) for a, b in zip(steps.start, steps.end)]
    assert per == [13] * len(steps) and len(steps) == 5
