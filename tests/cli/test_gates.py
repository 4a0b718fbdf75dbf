"""CI gates on real traces: `analyze --fail-on` and `diff --fail-if-slower` exit 3 after writing
every output, 0 when nothing trips, 2 on a usage error."""
from __future__ import annotations

import json
import shutil

import pytest
from clisupport import DATA, aiprof


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """fp32_matmul: a high cause (MATMUL_OFF_TENSOR_CORES); healthy: the same GPT-2 job without it
    (its step 5 % shorter); medium: the v3b nanoGPT job with its LayerNorms compiled (lncompile_fix),
    medium causes at most (UNCOMPILED_KERNEL_RUNS on the rest of its eager model, 9.3 %; the eager job
    and the scenario GPT-2 have high ones)."""
    d = tmp_path_factory.mktemp("gates")
    for name in ("fp32_matmul", "healthy"):
        shutil.copy(DATA / "scenarios" / f"{name}.json.gz", d / f"{name}.json.gz")
    shutil.copytree(DATA / "v3b" / "lncompile_fix", d / "medium")
    return {"fp32_matmul": str(d / "fp32_matmul.json.gz"), "healthy": str(d / "healthy.json.gz"), "medium": str(d / "medium")}


def test_fail_on_high_trips_after_writing_outputs(traces, tmp_path):
    res = aiprof("analyze", traces["fp32_matmul"], "--fail-on", "high", "--out", str(tmp_path / "rep"))
    assert res.returncode == 3, res.stderr
    assert "Causes" in res.stdout and (tmp_path / "rep" / "report.txt").is_file()
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert any(c["severity"] == "high" for c in rep["causes"])
    assert res.stderr.strip().splitlines()[-1].startswith("aiprof: --fail-on high: ")
    assert "MATMUL_OFF_TENSOR_CORES (high)" in res.stderr
    js = aiprof("analyze", traces["fp32_matmul"], "--fail-on", "high", "--json")
    assert js.returncode == 3 and json.loads(js.stdout)["causes"]  # the JSON is whole on stdout


def test_fail_on_levels(traces):
    rep = json.loads(aiprof("analyze", traces["medium"], "--json").stdout)
    sev = {c["severity"] for c in rep["causes"]}
    assert "high" not in sev and "medium" in sev  # the fixture's premise
    assert aiprof("analyze", traces["medium"], "--fail-on", "high").returncode == 0
    res = aiprof("analyze", traces["medium"], "--fail-on", "medium")
    assert res.returncode == 3 and "--fail-on medium" in res.stderr
    bad = aiprof("analyze", traces["medium"], "--fail-on", "low")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_fail_if_slower(traces):
    a, b = traces["healthy"], traces["fp32_matmul"]
    d = json.loads(aiprof("diff", a, b, "--json").stdout)
    pct = 100.0 * (d["compare"]["duration_us"] - d["base"]["duration_us"]) / d["base"]["duration_us"]
    assert pct > 5  # the fixture's premise: B's median step is over 5 % slower
    res = aiprof("diff", a, b, "--fail-if-slower", "5")
    assert res.returncode == 3, res.stderr
    assert "aiprof diff" in res.stdout  # the diff is printed before the gate
    assert "B's median step" in res.stderr and f"{pct:+.1f}%" in res.stderr
    assert aiprof("diff", a, b, "--fail-if-slower", f"{pct + 1:.1f}").returncode == 0
    assert aiprof("diff", b, a, "--fail-if-slower", "5").returncode == 0  # faster is no regression
    assert aiprof("diff", a, a, "--fail-if-slower", "0").returncode == 0  # same step: +0 %


def test_fail_if_slower_usage(traces):
    res = aiprof("diff", traces["healthy"], "--fail-if-slower", "5")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "two captures" in res.stderr
