"""Hardware samples (the agent's hw.csv) become the store's `hw` table."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from aiprof.analysis.timeseries import load_hw
from aiprof.trace.store import open_capture

ROOT = Path(__file__).resolve().parents[2]


def test_hw_csv_ingested_and_invalidates_cache(tmp_path, gpt2_stall):
    d = tmp_path / "cap" / "rank0"
    d.mkdir(parents=True)
    shutil.copy(gpt2_stall, d / "trace.json.gz")
    rt = open_capture(str(tmp_path / "cap")).ranks[0]
    assert len(rt.hw) == 0 and load_hw(rt) is None
    t0 = int(rt.kernels["ts"][0]) / 1000.0
    rows = ["ts_us,device,metric,value"]
    rows += [f"{t0 + 100_000 * i:.3f},gpu0,gpu_util_pct,{50 + i}" for i in range(4)]
    rows += [f"{t0 + 100_000 * i:.3f},host,cpu_util_pct,{10 * i}" for i in range(4)]
    rows.append(f"{t0:.3f},gpu0,torn")  # an interrupted write leaves a torn last line
    (d / "hw.csv").write_text("\n".join(rows) + "\n")
    rt = open_capture(str(tmp_path / "cap")).ranks[0]  # hw.csv appeared: re-ingested
    h = rt.hw
    assert len(h) == 8
    assert (np.diff(h["ts"]) >= 0).all()
    assert set(h["name"]) == {"gpu0 gpu_util_pct", "host cpu_util_pct"}
    hw = load_hw(rt)
    ts, v = hw.series[("gpu0", "gpu_util_pct")]
    assert v.tolist() == [50, 51, 52, 53] and ts[1] - ts[0] == 100_000_000


def test_real_capture_has_host_samples_on_trace_clock(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "aiprof", "run", "--skip", "2", "--duration-ms", "1000", "--what", "kernels,hw",
                          "--out", str(out), "--capture-id", "c", "--", sys.executable,
                          str(ROOT / "examples" / "tiny_train.py"), "--steps", "600"],
                         capture_output=True, text=True, timeout=180)
    if not (out / "c" / "rank0" / "hw.csv").exists():
        raise AssertionError(f"no hw.csv: rc={res.returncode}\n{res.stderr[-2000:]}")
    rt = open_capture(str(out / "c")).ranks[0]
    h = rt.hw
    assert {"cpu_util_pct", "proc_rss_bytes"} <= set(h["metric"])
    lo, hi = int(rt.ops["ts"].min()), int((rt.ops["ts"] + rt.ops["dur"]).max())
    # samples are on the trace's clock: inside the captured window, give or take a sample period
    assert lo - 1_000_000_000 <= h["ts"].min() and h["ts"].max() <= hi + 1_000_000_000
