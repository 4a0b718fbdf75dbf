"""Step diff, the diff verb, and findings on the real traces and on CPU traces made here."""
from __future__ import annotations

import dataclasses
import json

import pytest

from aiprof.analysis import findings as F
from aiprof.analysis.diff import diff_captures, diff_steps
from aiprof.analysis.report import build_report
from aiprof.cli.main import main as cli_main
from aiprof.trace.store import open_capture

KEYS = {"code", "severity", "title", "rank", "step", "where", "impact_us", "evidence", "suggestion"}


@pytest.fixture(scope="module")
def gpt2(gpt2_stall):
    return open_capture(str(gpt2_stall)).ranks[0]


@pytest.fixture(scope="module")
def gpt2_report(gpt2_stall):
    return build_report(open_capture(str(gpt2_stall)))


@pytest.fixture(scope="module")
def ddp_report(ddp2_dir):
    return build_report(open_capture(str(ddp2_dir)))


def test_default_diff_is_median_vs_slowest(gpt2):
    d = diff_steps(gpt2)
    assert d.base["step"] == 2 and d.compare["step"] == 3  # step 2 has the median duration
    assert d.delta_us == pytest.approx(162_172.183 - 77_928.409)
    top = d.items[0]
    assert (top.kind, top.name, top.host_kind) == ("gap", "<built-in function sleep>", "python")
    assert top.delta_us == pytest.approx(80_190.079) and top.delta_calls == 1
    assert top.stack[-2:] == ["gpt_train.py(22): get_batch", "<built-in function sleep>"]
    assert abs(d.residual_us) < 1.0  # one stream, no overlap: the items add up to the difference
    host = {(i.kind, i.name): i for i in d.host_items}
    assert host[("python", "gpt_train.py(22): get_batch")].delta_us > 80_000


def test_diff_explicit_steps_and_direction(gpt2):
    d = diff_steps(gpt2, base=3, compare=4)
    assert d.delta_us < -80_000
    assert d.items[0].name == "<built-in function sleep>" and d.items[0].delta_us < -80_000


def test_diff_two_ranks_finds_the_extra_matmuls(ddp2_dir):
    cap = open_capture(str(ddp2_dir))
    d = diff_captures(cap.rank(0), cap.rank(1), top=10_000)
    kern = [i for i in d.items if i.kind == "kernel" and i.delta_calls == 60]
    assert kern, "rank 1 runs 60 extra matmuls per step"
    assert kern[0].name.startswith("nvjet_") and 8_000 < kern[0].delta_us < 14_000
    # builtins carry per-process addresses; items must match across the two processes
    assert not any(" at 0x" in i.name for i in d.items + d.host_items)
    rb = [i for i in d.host_items if i.name == "<built-in method run_backward of torch._C._EngineBase object>"]
    assert rb and rb[0].base_calls == rb[0].compare_calls == 1


def test_diff_cli(gpt2_stall, ddp2_dir, capsys):
    assert cli_main(["diff", str(gpt2_stall), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "aiprof.diff/1" and out["compare"]["step"] == 3
    assert out["items"][0]["name"] == "<built-in function sleep>"
    assert cli_main(["diff", str(gpt2_stall), "--base", "1", "--compare", "5"]) == 0
    text = capsys.readouterr().out
    assert "step 5" in text and "step 1" in text and "Root items" in text
    assert cli_main(["diff", str(gpt2_stall), "--compare", "9"]) == 2
    assert "no step 9" in capsys.readouterr().err
    r0, r1 = sorted(str(p) for p in ddp2_dir.glob("*.json.gz"))
    assert cli_main(["diff", r0, r1, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["base"]["rank"] == 0


def test_gpt2_findings(gpt2_report):
    fs = gpt2_report["findings"]
    assert fs and all(set(f) == KEYS for f in fs)
    assert [f["impact_us"] for f in fs] == sorted((f["impact_us"] for f in fs), reverse=True)
    top = fs[0]
    assert top["code"] in ("STEP_OUTLIER", "DATA_LOADING") and top["step"] == 3
    assert "get_batch" in top["where"] and "sleep" in top["where"]
    assert 78_000 < top["impact_us"] < 90_000  # the extra ~80 ms
    codes = {f["code"]: f for f in fs}
    assert {"STEP_OUTLIER", "DATA_LOADING"} <= set(codes)
    assert "get_batch" in codes["DATA_LOADING"]["where"]
    # every high finding is about the stall; nothing else is high
    for f in fs:
        if f["severity"] == "high":
            assert f["step"] == 3 and "get_batch" in f["where"]
    assert "MEMCPY_PAGEABLE" not in codes and "LOW_TENSOR_CORE" not in codes and "COMM_EXPOSED" not in codes
    json.dumps(gpt2_report)  # JSON-ready


def test_ddp_findings(ddp_report):
    fs = ddp_report["findings"]
    comm = [f for f in fs if f["code"] == "COMM_EXPOSED"]
    assert [f["rank"] for f in comm] == [0]  # the waiting rank, not the straggler
    ev = comm[0]["evidence"]
    assert ev["straggler"]["straggler_rank"] == 1
    assert any(k["delta_calls"] == 60 for k in ev["straggler"]["extra_kernels"])
    assert "rank 1" in comm[0]["suggestion"]
    r0, r1 = ddp_report["ranks"]
    assert r0["summary"]["communication_us"] > 3 * r1["summary"]["communication_us"]


def test_rules_fire_on_their_evidence(gpt2):
    # rule logic on real facts with one fact changed: fp32 GEMMs and pageable copies
    from aiprof.analysis.report import _analyse_rank

    _, facts = _analyse_rank(gpt2, None, 15)
    k = facts.kernels
    slow = dataclasses.replace(k, non_tc_matmul_us=0.5 * k.matmul_us, non_tc_matmul_kernels=["volta_sgemm_128x64_nn"])
    f = F.low_tensor_core(dataclasses.replace(facts, kernels=slow))
    assert len(f) == 1 and f[0]["code"] == "LOW_TENSOR_CORE"
    assert f[0]["impact_us"] == pytest.approx(0.5 * k.matmul_us * (1 - 1 / F.LOW_TC_ASSUMED_SPEEDUP))
    assert F.low_tensor_core(facts) == []
    # the trace's 5 pageable copies (30 µs) are below the threshold; 100x more would not be
    assert facts.pageable["count"] == 5 and F.memcpy_pageable(facts) == []
    big = dict(facts.pageable, dur_us=facts.pageable["dur_us"] * 100)
    f = F.memcpy_pageable(dataclasses.replace(facts, pageable=big))
    assert f and "pin_memory" in f[0]["suggestion"]


@pytest.fixture(scope="module")
def cpu_reports(tmp_path_factory):
    from _diag import tiny_trace

    slow = tiny_trace(tmp_path_factory.mktemp("slow"), slow_step=5)
    healthy = tiny_trace(tmp_path_factory.mktemp("healthy"))
    return build_report(open_capture(str(slow))), build_report(open_capture(str(healthy)))


def test_cpu_traces(cpu_reports):
    slow, healthy = cpu_reports
    assert not any(f["severity"] == "high" for f in healthy["findings"]), (
        [(f["code"], f["title"], f["evidence"].get("mad_us")) for f in healthy["findings"]],
        [s["duration_us"] for s in healthy["ranks"][0]["steps"]])
    gpu_codes = {"DATA_LOADING", "GPU_IDLE_HOST_BOUND", "COMM_EXPOSED", "LOW_TENSOR_CORE", "KERNEL_HOTSPOT",
                 "MEMCPY_PAGEABLE", "SYNC_STALL"}
    assert not gpu_codes & {f["code"] for f in slow["findings"] + healthy["findings"]}
    # (a loaded CI machine can make other tiny CPU steps slow too: those may be reported as well)
    out = [f for f in slow["findings"] if f["code"] == "STEP_OUTLIER"]
    assert out and "get_batch" in out[0]["where"] and "sleep" in out[0]["where"]
    steps = {s["step"]: s["duration_us"] for s in slow["ranks"][0]["steps"]}
    assert out[0]["step"] == max(steps, key=steps.get)
    assert out[0]["impact_us"] > 55_000 and out[0]["severity"] == "high"  # the injected 60 ms sleep


def test_analyze_text_shows_findings(gpt2_stall, capsys):
    assert cli_main(["analyze", str(gpt2_stall)]) == 0
    text = capsys.readouterr().out
    assert "1. [high] STEP_OUTLIER" in text or "1. [high] DATA_LOADING" in text
    assert "Bottleneck ratio by class" in text and "Blocking synchronisations" in text


def test_recurring_outlier_steps_are_one_finding(tmp_path):
    """A stall that recurs every 5 steps (the GPT-2 trace's steps replicated 6 times) is one
    STEP_OUTLIER about the worst step, with the period and the summed extra time."""
    import importlib.util
    from pathlib import Path

    from aiprof.analysis.report import build_report
    from aiprof.trace.store import open_capture

    bench = Path(__file__).resolve().parents[2] / "bench" / "ingest.py"
    spec = importlib.util.spec_from_file_location("bench_ingest", bench)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    trace = tmp_path / "rep.json"
    info = mod.generate(trace, 200)  # ~6 copies of the 5 profiled steps
    rep = build_report(open_capture(str(trace)))
    outl = [f for f in rep["findings"] if f["code"] == "STEP_OUTLIER"]
    assert len(outl) == 1
    ev = outl[0]["evidence"]
    assert ev["outliers"] == info["copies"] and f"every 5 steps" in outl[0]["title"]
    assert ev["outlier_steps"] == [3 + 5 * k for k in range(info["copies"])]
    assert outl[0]["impact_us"] == ev["total_extra_us"] > info["copies"] * 70_000
