"""A real capture made by the agent on an H200: `aiprof attach` to bench/gpt_train.py `forever`,
then `aiprof trigger -n 1 --what kernels` (tests/data/gpt2_attach_light_h200.json.gz)."""
from __future__ import annotations

import gzip
import json
import shutil

import pytest

from capsupport import REPO, aiprof

DATA = REPO / "tests" / "data" / "gpt2_attach_light_h200.json.gz"


def test_agent_gpu_trace_is_kineto_with_step_and_marker():
    with gzip.open(DATA, "rt") as f:
        trace = json.load(f)
    ev = trace["traceEvents"]
    steps = {(e.get("cat"), e["name"]) for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {("user_annotation", "ProfilerStep#27"), ("gpu_user_annotation", "ProfilerStep#27")}
    assert sum(e.get("cat") == "kernel" for e in ev) > 1000
    (marker,) = [e for e in ev if e.get("name") == "aiprof::clock_sync"]
    step = next(e for e in ev if e.get("name") == "ProfilerStep#27" and e["cat"] == "user_annotation")
    assert marker["ts"] <= step["ts"]  # the marker is emitted right after the profiler starts


def test_analyze_reads_agent_gpu_capture(rt, tmp_path):
    if not (REPO / "src" / "aiprof" / "cli" / "analyze.py").exists():
        pytest.skip("aiprof analyze is not built yet")
    d = tmp_path / "cap" / "rank0"
    d.mkdir(parents=True)
    shutil.copy(DATA, d / "trace.json.gz")
    res = aiprof(rt, "analyze", str(tmp_path / "cap"), "--json", "--out", str(tmp_path / "rep"))
    assert res.returncode == 0, res.stderr
    (r,) = json.loads(res.stdout)["ranks"]
    assert [s["step"] for s in r["steps"]] == [27]
    assert r["steps"][0]["kernels_launched"] > 1000
