"""aiprof's own agent threads never show up as the job's Python code."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from aiprof.trace.store import open_capture

ROOT = Path(__file__).resolve().parents[2]


def test_agent_threads_dropped_but_hook_kept(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "aiprof", "run", "--skip", "2", "--iterations", "3", "--what",
                          "kernels,python,hw", "--hw-interval-ms", "20", "--out", str(out), "--capture-id", "c", "--",
                          sys.executable, str(ROOT / "examples" / "tiny_train.py"), "--steps", "10"],
                         capture_output=True, text=True, timeout=180)
    assert (out / "c" / "rank0" / "trace.json.gz").exists(), res.stderr[-2000:]
    rt = open_capture(str(out / "c")).ranks[0]
    dropped = rt.meta["trace"].get("aiprof_agent_threads_dropped")
    assert dropped, "the sampler thread ran during the capture, so one thread must have been dropped"
    names = list(rt.python["name"])
    assert not any("aiprof/agent/hwmon.py" in n or "aiprof/agent/control.py" in n for n in names)
    assert any("tiny_train.py" in n for n in names)
    # the optimizer-step hook runs in the training thread: its cost stays visible
    assert any("aiprof/agent/steps.py" in n for n in names)
    assert set(rt.python["tid"].tolist()).isdisjoint(dropped)


def test_training_thread_kept_when_parents_are_lost(demo_capture):
    """The demo capture: torch's tracer loses the parent ids of the training thread's frames after
    the stop, so the step hook's agent frames have no parent; that thread is still the job's."""
    rt = open_capture(str(demo_capture)).ranks[0]
    dropped = rt.meta["trace"].get("aiprof_agent_threads_dropped") or []
    a = rt.annotations
    steps = a["tid"][a.strings("name").isin_labels(lambda s: s.startswith("ProfilerStep#"))]
    assert len(steps) and set(steps.tolist()).isdisjoint(dropped)
    assert any("get_batch" in n for n in rt.python["name"])
