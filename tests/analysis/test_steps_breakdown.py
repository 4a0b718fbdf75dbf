"""Steps and the per-step breakdown on real traces."""
from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiprof.analysis.breakdown import step_breakdown
from aiprof.analysis.intervals import union
from aiprof.pipeline import build_report
from aiprof.analysis.steps import find_steps
from aiprof.report import text
from aiprof.trace.store import open_capture

ROOT = Path(__file__).resolve().parents[2]


def _profiler_steps(path) -> list[tuple[int, float]]:
    with gzip.open(path) as f:
        ev = json.load(f)["traceEvents"]
    return sorted((int(e["name"].split("#")[1]), e["dur"]) for e in ev
                  if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))


def test_steps_equal_profiler_step_events(gpt2_stall):
    rt = open_capture(str(gpt2_stall)).ranks[0]
    steps = find_steps(rt)
    want = _profiler_steps(gpt2_stall)
    assert steps.source == "ProfilerStep"
    assert steps.number.tolist() == [n for n, _ in want] == [1, 2, 3, 4, 5]
    assert np.allclose((steps.end - steps.start) / 1000.0, [d for _, d in want], atol=0.001)


def test_breakdown_adds_up_and_step3_idles(gpt2_stall):
    rt = open_capture(str(gpt2_stall)).ranks[0]
    bd = step_breakdown(rt, find_steps(rt))
    for s in bd:
        parts = s.compute_us + s.communication_us + s.memory_us + s.idle_us
        assert abs(parts - s.duration_us) <= 0.01 * s.duration_us
        assert 0 <= s.gpu_busy_pct <= 100
    idle = {s.step: s.idle_us for s in bd}
    others = [v for k, v in idle.items() if k != 3]
    # ground truth: an 80 ms host sleep in step 3 leaves the GPU idle
    assert idle[3] > 3 * max(others)
    assert idle[3] - np.median(others) > 70_000
    # GPU work is the same every step: the compute time barely moves
    comp = [s.compute_us for s in bd]
    assert max(comp) - min(comp) < 0.02 * max(comp)
    assert all(s.kernels_launched == bd[1].kernels_launched for s in bd[1:])


def test_ddp_comm_is_communication(ddp2_dir):
    cap = open_capture(str(ddp2_dir))
    rep = build_report(cap)
    assert [r["rank"] for r in rep["ranks"]] == [0, 1]
    r0, r1 = rep["ranks"]
    for r in (r0, r1):
        for s in r["steps"]:
            assert s["communication_total_us"] > 0
            assert s["communication_us"] <= s["communication_total_us"] + 1e-6
            assert abs(s["compute_us"] + s["communication_us"] + s["memory_us"] + s["idle_us"] - s["duration_us"]) < 0.01 * s["duration_us"]
    # rank 0 waits for the straggler inside all-reduce: more exposed communication, less compute
    assert r0["summary"]["communication_us"] > 3 * r1["summary"]["communication_us"]
    assert r1["summary"]["compute_us"] > r0["summary"]["compute_us"]
    assert r0["top_kernels"][0]["name"].startswith("ncclDevKernel_AllReduce")


def test_union_covered_matches_bruteforce():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 10_000, 300)
    e = s + rng.integers(0, 200, 300)
    u = union(s, e)
    grid = np.zeros(10_300, dtype=bool)
    for a, b in zip(s, e):
        grid[a:b] = True
    for a, b in [(0, 10_300), (17, 4_000), (5_000, 5_001), (9_990, 10_300), (3_000, 2_000)]:
        want = int(grid[a:max(a, b)].sum())
        assert int(u.covered(a, b)[0]) == want


def _cpu_trace(tmp_path, extra=()) -> Path:
    out = tmp_path / "cpu.json.gz"
    subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_train.py"), "--steps", "8", "--slow-step", "5",
                    "--slow-ms", "50", "--profile", str(out), *extra], check=True, timeout=300, capture_output=True)
    return out


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    return _cpu_trace(tmp_path_factory.mktemp("cpu"))


def test_real_cpu_profiler_trace(cpu_trace):
    """A trace from real torch.profiler on CPU: no GPU events, still steps and a breakdown."""
    rep = build_report(open_capture(str(cpu_trace)))
    r = rep["ranks"][0]
    assert r["step_source"] == "ProfilerStep"
    nums = [s["step"] for s in r["steps"]]
    assert nums == list(range(2, 8))  # schedule(wait=1, warmup=1, active=6)
    slow = {s["step"]: s["duration_us"] for s in r["steps"]}
    assert slow[5] > 45_000 and slow[5] > 2 * np.median([v for k, v in slow.items() if k != 5])
    for s in r["steps"]:
        assert s["compute_us"] == 0 and s["idle_us"] == pytest.approx(s["duration_us"])
    assert r["top_kernels"] == []


def test_cpu_only_text_report_has_no_gpu_breakdown(cpu_trace, gpt2_stall):
    """Issue 18 item 7: on a real CPU-only capture the text report prints no GPU breakdown (all
    zero there); a GPU capture keeps it."""
    def render(path) -> str:
        buf = io.StringIO()
        text.render(build_report(open_capture(str(path))), file=buf)
        return buf.getvalue()

    cpu = render(cpu_trace)
    assert "no GPU activity in this capture (CPU only)" in cpu
    for gpu_only in ("GPU busy", "comm (exposed)", "GPU idle", "GPU launched", "idle"):
        assert gpu_only not in cpu.replace("no GPU breakdown", ""), gpu_only
    assert "Host hotspots (Python functions, ops), by inclusive time" in cpu and "step" in cpu
    gpu = render(gpt2_stall)
    assert "GPU busy" in gpu and "comm (exposed)" in gpu and "GPU idle ms" in gpu and "CPU only" not in gpu


def test_optimizer_steps_and_entry_and_window(cpu_trace, tmp_path):
    """Without ProfilerStep: Optimizer.step annotations, an entry function, or the window."""
    with gzip.open(cpu_trace) as f:
        doc = json.load(f)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep#")]
    p = tmp_path / "noprofstep.json"
    p.write_text(json.dumps(doc))
    rt = open_capture(str(p)).ranks[0]
    st = find_steps(rt)
    assert st.source == "optimizer" and len(st) == 6
    assert (st.end > st.start).all() and (st.start[1:] == st.end[:-1]).all()
    st = find_steps(rt, entry="train_step")
    assert st.source == "entry:train_step" and len(st) == 6
    # train_step excludes get_batch: in iteration 5 the ProfilerStep holds the 50 ms sleep and
    # the train_step inside it does not (a difference, so machine load cannot break it)
    prof = find_steps(open_capture(str(cpu_trace)).ranks[0])
    i5 = list(prof.number).index(5)
    inside = (st.start >= prof.start[i5]) & (st.end <= prof.end[i5])
    assert inside.sum() == 1
    assert (prof.end[i5] - prof.start[i5]) - (st.end[inside][0] - st.start[inside][0]) >= 45_000_000
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("Optimizer.step")]
    p2 = tmp_path / "bare.json"
    p2.write_text(json.dumps(doc))
    # no marker at all: the model's forwards repeat, one per iteration (analysis/iterations.py)
    st = find_steps(open_capture(str(p2)).ranks[0])
    assert st.source == "module:Sequential_0" and len(st) == 6
    # and with nothing that repeats (one event), the whole window is one step
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") == "M"] + [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10.0, "dur": 5.0, "pid": 1, "tid": 1, "args": {}}]
    p3 = tmp_path / "one.json"
    p3.write_text(json.dumps(doc))
    st = find_steps(open_capture(str(p3)).ranks[0])
    assert st.source == "window" and len(st) == 1
