"""bench/capture_stall.py runs end to end on CPU (the GPU run is the lead's): every mode takes
its capture, writes it the way the mode says, and reports a series around the capture's end."""
from __future__ import annotations

import json
import subprocess

from capsupport import PY, REPO, env_with


def test_capture_stall_bench_smoke_run(rt, tmp_path):
    res = subprocess.run([PY, str(REPO / "bench" / "capture_stall.py"), "--model", "tiny", "--rounds", "1",
                          "--before", "6", "--iterations", "2", "--after", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env_with(rt), check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "capture_stall.json").read_text())
    assert out["device"] == "cpu" and out["model"] == "tiny"
    rounds = {r["mode"]: r for r in out["rounds"]}
    assert sorted(rounds) == ["auto", "fork", "offthread", "offthread-late", "thread", "warmup"]
    assert rounds["fork"]["export"]["how"] == "fork" and rounds["thread"]["export"]["how"] == "thread"
    # the shipped path: the training thread only detached the profiler; the export thread finished it
    assert rounds["offthread"]["export"]["how"] == "offthread", rounds["offthread"]["export"]
    assert rounds["offthread"]["stop"]["how"] == "detached" and rounds["auto"]["stop"]["how"] == "stop_trace"
    for r in out["rounds"]:
        assert len(r["captured"]) == 2 and r["export"]["stop_ms"] is not None
        i = r["series_stop_index"]
        assert r["series_ms"][i] == r["stop_step_ms"] and r["series_ms"][i + 1] == r["first_after_ms"]
        assert len(r["series_ms"]) == i + 1 + 4
    assert set(out["summary_median_over_rounds"]) == {"auto", "fork", "offthread", "offthread-late", "thread"}
    assert "results:" in res.stdout and not list(tmp_path.glob("captures"))
