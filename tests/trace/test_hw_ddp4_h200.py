"""A real 4-rank DDP capture on H200s with NVML + GPM samples (tests/data/ddp4_hw, README there):
the store's `hw` table has each rank's GPU metrics, on the trace's clock, inside its window."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data" / "ddp4_hw"
NVML = ("gpu_util_pct", "sm_clock_mhz", "power_w", "mem_used_bytes", "mem_util_pct")
GPM = ("gpm_sm_util_pct", "gpm_tensor_util_pct", "gpm_dram_bw_util_pct", "gpm_sm_occupancy_pct")
SLOW = 2  # bench/ddp_hw.py: rank 2 runs 300 extra 8192^3 bf16 matmuls per step


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AIPROF_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield open_capture(str(DATA))
    finally:
        mp.undo()


def _window(rt) -> tuple[int, int]:
    """First and last instant of the trace (CUDA runtime calls and kernels), ns on the trace clock."""
    starts = [int(rt.table(t)["ts"].min()) for t in ("runtime", "kernels")]
    ends = [int((rt.table(t)["ts"] + rt.table(t)["dur"]).max()) for t in ("runtime", "kernels")]
    return min(starts), max(ends)


def test_every_rank_has_gpu_samples_inside_its_trace(cap):
    assert [r.rank for r in cap.ranks] == [0, 1, 2, 3]
    for rt in cap.ranks:
        h = rt.hw
        lo, hi = _window(rt)
        assert hi - lo > 1_000_000_000  # the capture spans more than a second
        for metric in NVML + GPM:
            name = f"gpu{rt.rank} {metric}"  # each rank samples its own GPU
            m = h["name"] == name
            ts, v = h["ts"][m], h["value"][m]
            inside = int(((ts >= lo) & (ts <= hi) & np.isfinite(v)).sum())
            assert inside >= (10 if metric in NVML else 6), (rt.rank, metric, inside)
            if metric in NVML:  # GPM gave NaN twice on gpu3 (gpm_dram_bw_util_pct): kept as sampled
                assert np.isfinite(v).all()
        util = h["value"][h["name"] == f"gpu{rt.rank} gpu_util_pct"]
        assert ((util >= 0) & (util <= 100)).all()
        assert not any(n.startswith("gpu") and not n.startswith(f"gpu{rt.rank} ") for n in set(h["name"]))


def test_the_slow_rank_is_the_busy_one(cap):
    """GPM tells the straggler apart: the slow rank's tensor cores work while the others' wait in NCCL."""
    def median(rt, metric: str) -> float:
        h = rt.hw
        lo, hi = _window(rt)
        m = (h["name"] == f"gpu{rt.rank} {metric}") & (h["ts"] >= lo) & (h["ts"] <= hi)
        return float(np.nanmedian(h["value"][m]))

    tensor = {rt.rank: median(rt, "gpm_tensor_util_pct") for rt in cap.ranks}
    power = {rt.rank: median(rt, "power_w") for rt in cap.ranks}
    assert tensor[SLOW] > 50 and all(v < 10 for r, v in tensor.items() if r != SLOW), tensor
    assert power[SLOW] > 1.5 * max(v for r, v in power.items() if r != SLOW), power
