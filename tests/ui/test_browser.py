"""The UI in a real headless Chromium against the running app on the fixture traces."""
from __future__ import annotations

import pytest

from tests.ui.conftest import open_page

PAGES = ["overview", "steps", "tables", "ranks", "timeline", "flame", "memory"]


@pytest.mark.parametrize("app", ["gpt2_app", "ddp_app"])
def test_every_page_loads_without_console_errors(app, page, request):
    served = request.getfixturevalue(app)
    for route in PAGES:
        open_page(page, served.url, route)
    # the ddp capture has two ranks: the rank picker reaches the second
    if app == "ddp_app":
        open_page(page, served.url, "overview?rank=1")
        assert page.inner_text("#kpi-steps") == "4"
    assert not page.errors


def _option(page, name):
    return page.evaluate(f"() => window.__aiprof.charts[{name!r}].getOption()")


def test_dashboard_charts_show_the_report_numbers(page, gpt2_app):
    """(Every number is checked in test_dashboard_numbers.py.) The causes, the note on missing
    hardware samples, and k: each kernel chart redraws its own top k and its "other" bar."""
    rr = gpt2_app.report["ranks"][0]
    open_page(page, gpt2_app.url, "overview")
    # causes first, in the report's order, each with the saving the report computed
    codes = page.eval_on_selector_all(".cause", "els => els.map(e => e.dataset.code)")
    assert codes == [c["code"] for c in gpt2_app.report["causes"]]
    savings = page.eval_on_selector_all(".cause .impact", "els => els.map(e => Number(e.dataset.savingUs))")
    assert savings == pytest.approx([c["saving"]["per_step_us"] for c in gpt2_app.report["causes"]])
    assert "No hardware samples" in page.inner_text("#p-gpu-util")
    page.fill("#topk", "5")
    page.dispatch_event("#topk", "change")
    page.wait_for_function("() => window.__aiprof.charts['kernel-calls'].getOption().series[0].data.length === 6")
    kt = [d["value"] for d in _option(page, "kernel-time")["series"][0]["data"]]
    assert kt[:5] == pytest.approx([k["total_us"] for k in rr["top_kernels"][:5]])
    assert sum(kt) == pytest.approx(rr["kernels"]["gpu_time_us"])  # the 6th bar: all the others
    kc = [d["value"] for d in _option(page, "kernel-calls")["series"][0]["data"]]
    assert kc[:5] == [k["calls"] for k in rr["kernels_by_calls"]["top"][:5]] and sum(kc) == rr["rows"]["kernels"]
    assert kc[:5] == sorted(kc[:5], reverse=True)


def test_step_diff_opens_from_two_clicks(page, gpt2_app):
    open_page(page, gpt2_app.url, "steps")
    page.click(".chip[data-step='2']")
    page.click(".chip[data-step='3']")
    page.wait_for_selector("#diff-table")
    sd = gpt2_app.report["ranks"][0]["step_diff"]  # the report's diff is also median (2) vs slowest (3)
    assert sd["base"]["step"] == 2 and sd["compare"]["step"] == 3
    assert page.inner_text("#diff-delta") == f"+{sd['delta_us'] / 1e3:.2f} ms"
    first = page.inner_text("#diff-table tbody tr:first-child")
    assert "sleep" in first and "+1" in first  # the injected time.sleep: one extra call
    # the step slider shows the chosen step's breakdown
    page.fill("#step-slider", "2")
    page.dispatch_event("#step-slider", "input")
    assert page.inner_text("#slider-label") == "step 3"


def test_timeline_zooms_and_shows_a_kernels_launching_op(page, gpt2_app):
    open_page(page, gpt2_app.url, "timeline")
    v0 = page.evaluate("() => window.__aiprof.timeline.view")
    n0 = page.evaluate("() => window.__aiprof.timeline.S.fetches")
    page.focus("#tl-canvas")
    page.keyboard.press("w")
    page.wait_for_function(f"() => window.__aiprof.timeline.S.fetches > {n0}")
    v1 = page.evaluate("() => window.__aiprof.timeline.view")
    assert (v1["t1"] - v1["t0"]) == pytest.approx(0.7 * (v0["t1"] - v0["t0"]), rel=1e-6)
    # mouse wheel zooms too
    box = page.locator("#tl-canvas").bounding_box()
    page.mouse.move(box["x"] + 700, box["y"] + 200)
    page.mouse.wheel(0, -400)
    page.wait_for_function(f"() => {{ const v = window.__aiprof.timeline.view; return v.t1 - v.t0 < {0.69 * (v1['t1'] - v1['t0'])}; }}")
    # search a GEMM kernel: Enter selects the first hit; the details show its launch call and launching op
    page.fill("#tl-search", "cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn")
    page.press("#tl-search", "Enter")
    page.wait_for_selector("#tl-op")
    assert page.inner_text("#tl-hits").startswith("5 match")
    assert "aten::mm" in page.inner_text("#tl-op")
    assert "cudaLaunchKernel" in page.inner_text("#tl-launch") or "cuLaunchKernel" in page.inner_text("#tl-launch")
    # the hit was framed: the kernel and its launch inside, and the window is small
    page.wait_for_function("() => window.__aiprof.timeline.S.pending === null")
    d = page.evaluate("() => window.__aiprof.timeline.S.detail")
    v = page.evaluate("() => window.__aiprof.timeline.view")
    assert v["t0"] <= d["launch"]["start"] and d["ref"]["end"] <= v["t1"]
    assert v["t1"] - v["t0"] < 50e6


def test_tables_are_linked(page, gpt2_app):
    open_page(page, gpt2_app.url, "tables")
    total = page.evaluate("() => window.__aiprof.tables.kernels.getDataCount('active')")
    page.locator("#t-python .tabulator-row", has_text="gpt_train.py(29): train_step").first.click()
    page.wait_for_selector("#link-box:not(.hidden)")
    assert "train_step" in page.inner_text("#link-box")
    shown = page.evaluate("() => window.__aiprof.tables.kernels.getDataCount('active')")
    linked = page.evaluate("() => window.__aiprof.lastLink.kernels.length")
    assert shown == linked and 0 < shown <= total


def test_ranks_flags_the_straggler(page, ddp_app):
    open_page(page, ddp_app.url, "ranks")
    rows = page.inner_text("#rank-table tbody")
    assert "straggler" in rows.splitlines()[1] or "straggler" in page.inner_text("#rank-table tr.straggler")
    heat = _option(page, "heat")["series"][0]["data"]
    assert len(heat) == 8  # 2 ranks x 4 steps
    assert page.locator("#comm-table tbody tr").count() >= 2


def test_memory_page_shows_the_peak(page, gpt2_app):
    open_page(page, gpt2_app.url, "memory")
    mem = gpt2_app.report["ranks"][0]["memory"]
    series = _option(page, "memory")["series"]
    assert max(p[1] for p in series[0]["data"]) == mem["peak_allocated_bytes"]
    assert page.locator("#alloc-snap tbody tr").count() > 0  # from the memsnap pickle


def test_static_html_report(page, gpt2_stall, tmp_path, gpt2_app):
    from aiprof.cli.main import main

    out = tmp_path / "overview.html"
    assert main(["analyze", str(gpt2_stall), "--html", str(out)]) == 0
    html = out.read_text()
    assert "http://" not in html.split("<script", 1)[0] and "src=\"./assets" not in html
    page.goto(out.as_uri())
    page.wait_for_function("() => document.querySelector('#page').dataset.ready === '1'")
    s = gpt2_app.report["ranks"][0]["summary"]
    active = {d["name"]: d["value"] for d in _option(page, "gpu-active")["series"][0]["data"]}
    assert active["idle"] == pytest.approx(s["idle_us"])
