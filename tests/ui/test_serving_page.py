"""The Serving page in a real headless Chromium: it draws the report's serving numbers for the
real H100 GPT-2 generate trace, and says so plainly for a training trace."""
from __future__ import annotations

import shutil

import pytest

from tests.conftest import DATA
from tests.ui.conftest import _serve, open_page


@pytest.fixture(scope="module")
def gen_app(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    shutil.copy(DATA / "scenarios" / "generate_b1.json.gz", d / "generate_b1.json.gz")
    server, th, s = _serve([d / "generate_b1.json.gz"])
    yield s
    server.should_exit = True
    th.join(10)


def _option(page, name):
    return page.evaluate(f"() => window.__aiprof.charts[{name!r}].getOption()")


def test_serving_page_draws_the_report(page, gen_app):
    sv = gen_app.report["ranks"][0]["serving"]["summary"]
    open_page(page, gen_app.url, "serving")
    assert page.inner_text("#kpi-tokens") == str(sv["tokens_out"]) == "24"
    assert page.inner_text("#kpi-tps") == f"{sv['tokens_per_s']:.1f}"
    iv, note = sv["interval"], page.inner_text("#kpi-tps-interval")
    assert note.startswith("tokens/s in the captured window: ") and iv["whole_run_reason"] in note
    assert f"({iv['duration_us'] / 1000:.2f} of {iv['capture_duration_us'] / 1000:.2f} ms)" in note
    hist = {s["name"]: s["data"] for s in _option(page, "serving-hist")["series"]}
    assert hist == sv["histogram"]["counts"] and sum(hist["decode"]) == 23 and sum(hist["prefill"]) == 1
    share = {d["name"]: d["value"] for d in _option(page, "serving-share")["series"][0]["data"]}
    assert share == pytest.approx({p: v["time_us"] for p, v in sv["by_phase"].items()})
    assert _option(page, "serving-batch")["series"][0]["data"] == sv["batch"]["iterations"]
    assert _option(page, "serving-throughput")["series"][0]["data"] == pytest.approx(sv["throughput"]["tokens_per_s"])
    assert page.eval_on_selector_all("#phase-table tr[data-phase]", "els => els.map(e => e.dataset.phase)") == ["prefill", "decode"]
    assert not page.errors


def test_training_trace_is_not_serving(page, gpt2_app):
    open_page(page, gpt2_app.url, "serving")
    assert "Not a serving trace" in page.inner_text("#serving-none")
    assert not page.errors
