"""Serving semantics per iteration (analysis/serving.py) against what the program itself knows:
the tokens it asked for, and the continuous-batching engine's own per-step batch."""
from __future__ import annotations

import io

from aiprof.analysis.breakdown import step_breakdown
from aiprof.pipeline import build_report
from aiprof.analysis.serving import serving_analysis
from aiprof.analysis.steps import find_steps
from aiprof.report import text
from aiprof.trace.store import open_capture
from tests.serving.support import fixture_rank, rank, truth


def _serving(rt):
    st = find_steps(rt)
    return serving_analysis(rt, st, step_breakdown(rt, st))


def test_padded_generate_phases_and_tokens(captures, tmp_path):
    t = truth(captures, "generate")
    sv = _serving(rank(captures, "generate", tmp_path))
    ph = [it.phase for it in sv.iterations]
    assert ph == ["prefill"] + ["decode"] * (t["new_tokens"] - 1)
    first, rest = sv.iterations[0], sv.iterations[1:]
    assert (first.tokens_in, first.tokens_out) == (t["batch"] * t["prompt"], t["batch"])  # padding included
    assert all((it.tokens_in, it.tokens_out) == (t["batch"], t["batch"]) for it in rest)
    s = sv.summary
    assert s["tokens_out"] == t["batch"] * t["new_tokens"]
    assert s["batch"]["median"] == t["batch"]
    assert abs(s["tokens_per_s"] - s["tokens_out"] / (s["span_us"] / 1e6)) < 1e-6 * s["tokens_per_s"]
    assert s["gpu_busy_pct"] is None  # a CPU capture
    assert all(it.forward_us > 0 and it.host_overhead_us >= 0 for it in sv.iterations)


def test_phases_match_the_continuous_batching_engine(captures, tmp_path):
    t = truth(captures, "cb")
    sv = _serving(rank(captures, "cb", tmp_path))
    busy = [it for it in sv.iterations if it.phase != "idle"]
    assert len(busy) == t["engine_steps"] == len(t["steps"])
    for it, eng in zip(busy, t["steps"]):
        want = "prefill" if not eng["decode"] else "decode" if not eng["prefill"] else "mixed"
        assert it.phase == want, (it, eng)
        assert it.tokens_in == eng["q_tokens"]
        if want == "decode":
            assert it.tokens_out == eng["new_tokens"] == eng["requests"]
        else:  # a packed batch samples a row for a prompt still being chunked; the engine drops it
            assert eng["new_tokens"] <= it.tokens_out <= eng["requests"]
    assert abs(sv.summary["tokens_out"] - t["tokens"]) <= 0.05 * t["tokens"]
    assert sv.summary["by_phase"]["idle"]["tokens_out"] == 0


def test_prefill_beside_decodes_is_mixed_and_spikes_the_token_gap(captures, tmp_path):
    t = truth(captures, "cb_stall")
    sv = _serving(rank(captures, "cb_stall", tmp_path))
    busy = [it for it in sv.iterations if it.phase != "idle"]
    want = ["prefill" if not e["decode"] else "decode" if not e["prefill"] else "mixed" for e in t["steps"]]
    assert [it.phase for it in busy] == want
    big = max(busy, key=lambda it: it.tokens_in)
    assert big.phase == "mixed" and big.tokens_in > 1000
    # the 1024-token prompt is the longest gap between two tokens of the running sequences
    assert sv.summary["inter_token_us"]["max"] >= big.duration_us


def test_training_is_not_serving(captures, tmp_path):
    assert _serving(rank(captures, "train", tmp_path)) is None


def test_gpu_generate_fixture(tmp_path):
    sv = _serving(fixture_rank("scenarios/generate_b1.json.gz", tmp_path))
    s = sv.summary
    assert sv.model == "GPT2LMHeadModel_0" and sv.vocab == 50257
    assert {p: v["iterations"] for p, v in s["by_phase"].items()} == {"prefill": 1, "decode": 23}
    assert s["tokens_out"] == 24 and s["batch"]["sizes"] == [1]
    assert 0 < s["gpu_busy_pct"] < 10  # batch-1 eager decode on an H100: the GPU mostly waits
    assert sum(s["histogram"]["counts"]["decode"]) == 23
    assert len(s["throughput"]["t_us"]) == len(s["throughput"]["tokens_per_s"])


def test_report_and_text(tmp_path):
    rt = fixture_rank("scenarios/generate_b1.json.gz", tmp_path)
    rep = build_report(open_capture(rt.source, show_progress=False))
    r = rep["ranks"][0]
    assert r["step_source"] == "module:GPT2LMHeadModel_0" and r["step_within"] == "ProfilerStep"
    assert r["serving"]["summary"]["tokens_out"] == 24
    buf = io.StringIO()
    text.render(rep, file=buf)
    out = buf.getvalue()
    assert "Steps (from module:GPT2LMHeadModel_0 within ProfilerStep)" in out
    assert "Serving · model GPT2LMHeadModel_0" in out and "tokens/s" in out
    assert "decode" in out and "prefill" in out


def test_tokens_per_s_says_its_interval(captures, tmp_path):
    """tokens/s covers the captured window's model iterations, and the report says so: where in the
    capture, how long, and why there is no whole-run figure beside it (no agent saw the run)."""
    for mode in ("generate", "cb_stall"):
        rt = rank(captures, mode, tmp_path)
        sv = _serving(rt)
        s, iv = sv.summary, sv.summary["interval"]
        busy = [it for it in sv.iterations if it.phase != "idle"]
        # the interval is the first to the last model iteration, inside the capture
        assert iv["covers"] == "captured window"
        assert iv["start_ns"] == busy[0].start_ns
        assert iv["end_ns"] == max(it.start_ns + round(it.duration_us * 1000) for it in busy)
        assert iv["duration_us"] == s["span_us"] and s["tokens_per_s"] == s["tokens_out"] / (iv["duration_us"] / 1e6)
        assert 0 <= iv["from_capture_start_us"] < iv["to_capture_start_us"] <= iv["capture_duration_us"]
        # a raw torch.profiler capture: nothing saw the rest of the run
        assert iv["whole_run_tokens_per_s"] is None and "captured window's, not the run's" in iv["whole_run_reason"]
        buf = io.StringIO()
        text.render(build_report(open_capture(rt.source)), buf, width=400)
        line = next(x for x in buf.getvalue().splitlines() if x.startswith("tokens/s interval:"))
        assert line.startswith("tokens/s interval: the captured window, its first to last model iteration, ")
        assert f"({iv['duration_us'] / 1000:,.2f} of {iv['capture_duration_us'] / 1000:,.2f} ms)" in line
        assert f"whole run: — ({iv['whole_run_reason']})" in line
