"""The GPU's PM counters in the browser timeline: samples recorded on an H100 at 100 µs
(tests/data/pm, written through the agent's own writer), served by the app and checked in
headless Chromium: the "GPU counters" group sits under the GPU's tracks, and its tracks hold what
the server's level-of-detail answer holds for the view, again after a zoom."""
from __future__ import annotations

import importlib.util
import json
import urllib.request
from pathlib import Path

import pytest

from tests.ui.conftest import _serve, open_page

TL = "window.__aiprof.timeline"
SM = "pm:gpu0:pm_sm_active_pct"


def _pm_capture(root: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "pm_capture", Path(__file__).resolve().parents[1] / "analysis" / "test_counters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cap, _ = mod.make_capture(root, mod._rec())
    return cap


@pytest.fixture(scope="module")
def pm_app(tmp_path_factory):
    server, th, s = _serve([_pm_capture(tmp_path_factory.mktemp("pm"))])
    yield s
    server.should_exit = True
    th.join(10)


def _served(app, view: dict, px: int) -> dict:
    q = f"rank=0&t0={int(view['t0'] // 1)}&t1={-int(-view['t1'] // 1)}&px={px}"
    with urllib.request.urlopen(app.url + "api/timeline/counters?" + q) as r:
        return json.load(r)["counters"]


def _counters_after(page, n: int) -> dict:
    page.wait_for_function(f"() => {TL}.S.fetches > {n} && {TL}.S.pending === null && '{SM}' in {TL}.counters(0)")
    return page.evaluate(f"() => {TL}.counters(0)")


def test_pm_counter_tracks_under_the_gpu_follow_the_view(page, pm_app):
    open_page(page, pm_app.url, "timeline")
    rows = page.evaluate(f"() => {TL}.rows()")
    heads = [r for r in rows if r["kind"] == "head"]
    ids = [r["id"] for r in heads]
    assert "r0:pm" in ids
    pm_head = heads[ids.index("r0:pm")]
    n_counters = len([c for c in page.evaluate(f"() => {TL}.L(0).counters") if c["group"] == "gpu"])
    assert pm_head["label"] == f"GPU counters ({n_counters})" and n_counters >= 8
    # under the GPU: after the GPU's own head, one level deeper
    gpu = next(h for h in heads if h["id"].startswith("r0:g"))
    assert ids.index(gpu["id"]) < ids.index("r0:pm") and pm_head["level"] > gpu["level"]
    n = page.evaluate(f"() => {TL}.S.fetches")
    page.evaluate(f"() => {TL}.toggle('r0:pm', true)")
    got = _counters_after(page, n)
    labels = [r["label"] for r in page.evaluate(f"() => {TL}.rows()") if r["kind"] != "head"]
    names = [c["name"] for c in page.evaluate(f"() => {TL}.L(0).counters") if c["group"] == "gpu"]
    assert set(names) <= set(labels), (names, labels)  # one track per counter, now open
    d = page.evaluate(f"() => {{ const d = {TL}.data(0); return {{t0: d.t0, t1: d.t1, px: d.px}}; }}")
    want = _served(pm_app, d, d["px"])
    assert got[SM] == want[SM] and 0 < len(got[SM]["ts"]) <= d["px"]
    assert max(got[SM]["value"]) > 90  # the GEMM and elementwise phases kept the SMs busy
    # zoom in on the middle tenth: the tracks are fetched again for the new view, finer in time
    v = page.evaluate(f"() => {TL}.view")
    mid, w = (v["t0"] + v["t1"]) / 2, (v["t1"] - v["t0"]) / 20
    n = page.evaluate(f"() => {TL}.S.fetches")
    page.evaluate(f"() => {TL}.setView({mid - w}, {mid + w})")
    got2 = _counters_after(page, n)
    d2 = page.evaluate(f"() => {{ const d = {TL}.data(0); return {{t0: d.t0, t1: d.t1, px: d.px}}; }}")
    assert d2["t1"] - d2["t0"] < (d["t1"] - d["t0"]) / 5
    assert got2[SM] == _served(pm_app, d2, d2["px"])[SM]
    ts = got2[SM]["ts"]
    assert ts and d2["t0"] - 1e6 <= ts[0] and ts[-1] <= d2["t1"] + 1e6
