"""The multi-rank timeline in headless Chromium: the rank -> process -> thread / GPU -> stream
hierarchy, two ranks on the aligned clock, collectives linked across ranks, the keyboard flow
(zoom/pan keys, search hits, 'f' after "launched by", next/previous occurrence, flows for a
range, Esc) and names that stay distinct when shortened."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from aiprof.analysis.kernels import kernel_stats
from aiprof.analysis.ranks import matched_collectives
from tests.ui.conftest import open_page

TL = "window.__aiprof.timeline"


def _get(served, path: str) -> dict:
    with urllib.request.urlopen(served.url + "api/" + path) as r:
        return json.load(r)


def _view(page) -> tuple[float, float]:
    v = page.evaluate(f"() => {TL}.view")
    return v["t0"], v["t1"]


def _fetched(page, n: int) -> None:
    page.wait_for_function(f"() => {TL}.S.fetches > {n} && {TL}.S.pending === null")


def test_hierarchy_collapses_and_expands(page, gpt2_app):
    open_page(page, gpt2_app.url, "timeline")
    rows = page.evaluate(f"() => {TL}.rows()")
    heads = {r["id"]: r for r in rows if r["kind"] == "head"}
    rt = gpt2_app.data.rank(0)
    tl = gpt2_app.data.index(rt)
    main = next(ln for ln in tl.lanes if ln.group == "host" and ln.track.endswith("· main"))
    tid, pid = main.thread, main.proc
    assert {"r0", f"r0:p{pid}", f"r0:p{pid}:t{tid}"} <= set(heads)
    gpu = next(ln for ln in tl.lanes if ln.group == "gpu")
    assert {f"r0:g{gpu.proc}", f"r0:g{gpu.proc}:s{gpu.thread}"} <= set(heads)
    # the main thread of the first rank is open: one row per nesting depth
    depths = [ln for ln in tl.lanes if ln.group == "host" and ln.thread == tid]
    lane_rows = [r for r in rows if r["kind"] == "lane" and r["lane"] in {ln.id for ln in depths}]
    assert len(lane_rows) == len(depths) > 10
    # a click in the left column of its header closes it: it keeps its top row (depth 0) only
    h = heads[f"r0:p{pid}:t{tid}"]
    box = page.locator("#tl-canvas").bounding_box()
    n = page.evaluate(f"() => {TL}.S.fetches")
    page.mouse.click(box["x"] + 20, box["y"] + h["y"] + h["hgt"] / 2)
    _fetched(page, n)
    rows2 = page.evaluate(f"() => {TL}.rows()")
    h2 = next(r for r in rows2 if r.get("id") == f"r0:p{pid}:t{tid}")
    assert not h2["open"] and h2["lane"] == depths[0].id
    assert not [r for r in rows2 if r["kind"] == "lane" and r["lane"] in {ln.id for ln in depths}]
    # only the rows on screen are asked for: the closed thread's deeper lanes are not in the answer
    sent = page.evaluate(f"() => {TL}.data(0).lanes.map(e => e.id)")
    assert depths[0].id in sent and not set(sent) & {ln.id for ln in depths[1:]}
    # closing the rank leaves one row for it
    n = page.evaluate(f"() => {TL}.S.fetches")
    page.evaluate(f"() => {TL}.toggle('r0', false)")
    rows3 = page.evaluate(f"() => {TL}.rows()")
    assert [r["id"] for r in rows3] == ["r0"]
    page.evaluate(f"() => {TL}.toggle('r0', true)")
    _fetched(page, n)


def test_two_ranks_on_the_aligned_clock_with_collectives_linked(page, ddp_app):
    rep = ddp_app.report
    offsets = rep["cross_rank"]["alignment"]["offset_us"]
    open_page(page, ddp_app.url, "timeline")
    assert page.evaluate(f"() => {TL}.shown") == [0, 1]
    heads = [r["id"] for r in page.evaluate(f"() => {TL}.rows()") if r["kind"] == "head" and r["level"] == 0]
    assert heads == ["r0", "r1"]
    # every rank's events are on the aligned clock: own timestamp + the report's offset - origin
    data = ddp_app.data
    origin = data.origin()
    for r in (0, 1):
        assert data.offset_ns(r) == round(offsets[str(r)] * 1000)
        rt = data.rank(r)
        k = rt.kernels
        d = page.evaluate(f"() => {TL}.data({r})")
        drawn = [(row, s) for e in d["lanes"] for row, s, src in zip(e["events"]["row"], e["events"]["start"], e["events"]["source"])
                 if data.index(rt) and src == 4]  # 4: kernels
        assert drawn
        for row, s in drawn[:50]:
            assert s == int(k["ts"][row]) + data.offset_ns(r) - origin
    # matched collectives end together on the aligned clock (that is how the offset is defined)
    m = matched_collectives(data.capture, offsets)
    both = (m.local_start >= 0).all(axis=0)
    d_end = np.abs(m.end[0, both] - m.end[1, both])
    assert np.median(d_end) <= 1000 * max(1.0, rep["cross_rank"]["alignment"]["spread_us"]["1"] * 3)
    # pick a matched all-reduce: select it on rank 0, the details name who arrived last
    j = int(np.argmax(m.caused_ns))
    ev = next(p for p in _get(ddp_app, "timeline/collectives?t0=0&t1=1e13&limit=2000")["collectives"] if p["id"] == j)
    e0 = next(p for p in ev["ranks"] if p["rank"] == 0)["event"]
    page.evaluate(f"() => {TL}.select(0, '{e0['source']}', {e0['row']}).then(() => {TL}.fit())")
    page.wait_for_selector("#tl-coll")
    last = m.ranks[int(m.last[j])]
    assert page.inner_text("#tl-coll-last") == f"rank {last}"
    assert last == 1  # rank 1 is the straggler of this capture: it arrives last at every collective
    assert rep["cross_rank"]["arrivals"]["last_count"]["1"] == m.start.shape[1]
    text = page.inner_text("#tl-coll")
    wait_ns = m.start[1, j] - m.start[0, j]
    assert f"{wait_ns / 1e6:.2f} ms" in text or f"{wait_ns / 1e3:.1f} µs" in text
    # the links are drawn for the collectives in view, the same ones the API lists
    page.wait_for_function(f"() => {TL}.S.coll.length > 0")
    ids, win = page.evaluate(f"() => [{TL}.S.coll.map(c => c.id), {TL}.S.win]")
    api = _get(ddp_app, f"timeline/collectives?t0={win['t0']}&t1={win['t1']}&limit=400")
    assert j in ids and set(ids) <= {c["id"] for c in api["collectives"]}


def test_keyboard_flow(page, gpt2_app):
    rt = gpt2_app.data.rank(0)
    open_page(page, gpt2_app.url, "timeline")
    page.focus("#tl-canvas")
    page.mouse.move(0, 0)  # keys zoom at the centre when the pointer is not over the plot
    # zoom: w, ArrowUp in; s, ArrowDown out -- each by 0.7 about the centre
    for key, f in (("w", 0.7), ("ArrowUp", 0.7), ("s", 1 / 0.7), ("ArrowDown", 1 / 0.7)):
        a, b = _view(page)
        n = page.evaluate(f"() => {TL}.S.fetches")
        page.keyboard.press(key)
        _fetched(page, n)
        c, d = _view(page)
        assert d - c == pytest.approx(f * (b - a), rel=1e-6)
        assert (c + d) / 2 == pytest.approx((a + b) / 2, rel=1e-9)
    page.keyboard.press("w")
    # pan: a, ArrowLeft left; d, ArrowRight right -- each by a fifth of the view
    for key, f in (("a", -0.2), ("ArrowLeft", -0.2), ("d", 0.2), ("ArrowRight", 0.2)):
        a, b = _view(page)
        n = page.evaluate(f"() => {TL}.S.fetches")
        page.keyboard.press(key)
        _fetched(page, n)
        c, d = _view(page)
        assert c - a == pytest.approx(f * (b - a), rel=1e-6) and d - c == pytest.approx(b - a, rel=1e-6)
    # search: Enter jumps to the first hit and selects it, Enter again to the next, Shift+Enter back
    name = "cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1"
    page.fill("#tl-search", name)
    page.press("#tl-search", "Enter")
    page.wait_for_function(f"() => {TL}.S.detail && document.querySelector('#tl-hitpos').textContent === '1 / 5'")
    hits = page.evaluate(f"() => {TL}.S.hits.hits")
    assert len(hits) == 5 and [h["start"] for h in hits] == sorted(h["start"] for h in hits)
    assert page.evaluate(f"() => {TL}.S.sel.row") == hits[0]["row"]
    page.press("#tl-search", "Enter")
    page.wait_for_function(f"() => {TL}.S.sel.row === {hits[1]['row']}")
    assert page.inner_text("#tl-hitpos") == "2 / 5"
    a, b = _view(page)
    assert a <= hits[1]["start"] and hits[1]["end"] <= b  # framed
    page.press("#tl-search", "Shift+Enter")
    page.wait_for_function(f"() => {TL}.S.sel.row === {hits[0]['row']}")
    # the details carry the full name, not a shortened one
    full = rt.kernels.strings("name").labels[rt.kernels.strings("name").codes[hits[0]["row"]]]
    assert page.inner_text("#tl-sel-name") == full and name in full
    kernel = page.evaluate(f"() => {TL}.S.detail.ref")
    # "launched by" -> the launch call is selected; 'f' frames it with the kernel it launched
    page.click("#tl-launch a")
    page.wait_for_function(f"() => {TL}.S.detail.ref.source === 'runtime'")
    launched = page.evaluate(f"() => {TL}.S.detail.launched")
    assert [(k["source"], k["row"]) for k in launched] == [("kernels", kernel["row"])]
    page.focus("#tl-canvas")
    page.keyboard.press("f")
    page.wait_for_function(f"() => {TL}.S.pending === null")
    a, b = _view(page)
    launch = page.evaluate(f"() => {TL}.S.detail.ref")
    assert a <= launch["start"] and kernel["end"] <= b
    assert page.locator("#tl-launched").count() == 1
    # next / previous occurrence of the selected event's name: n / N
    page.evaluate(f"() => {TL}.select(0, 'kernels', {hits[0]['row']})")
    page.keyboard.press("n")
    page.wait_for_function(f"() => {TL}.S.sel.row !== {hits[0]['row']}")
    nxt = page.evaluate(f"() => {TL}.S.detail.ref")
    assert nxt["name"] == kernel["name"] and nxt["start"] > kernel["start"]
    assert nxt["row"] == hits[1]["row"]  # the next one of the same name is the next search hit
    page.keyboard.press("N")
    page.wait_for_function(f"() => {TL}.S.sel.row === {hits[0]['row']}")
    # Esc clears the selection
    page.keyboard.press("Escape")
    assert page.evaluate(f"() => {TL}.S.detail") is None
    # l: launch -> GPU flows for the view, the same the API gives for that range
    page.keyboard.press("l")
    page.wait_for_function(f"() => {TL}.flowsOf(0) !== null")
    f = page.evaluate(f"() => {TL}.flowsOf(0)")
    a, b = _view(page)
    api = _get(gpt2_app, f"timeline/flows?rank=0&t0={int(np.floor(a))}&t1={int(np.ceil(b))}&limit=2000")
    assert f["to_start"] == api["to_start"] and len(f["to_lane"]) > 0


def test_shift_drag_marks_a_range_for_flows(page, gpt2_app):
    open_page(page, gpt2_app.url, "timeline")
    box = page.locator("#tl-canvas").bounding_box()
    y = box["y"] + 40
    page.keyboard.down("Shift")
    page.mouse.move(box["x"] + 400, y)
    page.mouse.down()
    page.mouse.move(box["x"] + 600, y, steps=4)
    page.mouse.up()
    page.keyboard.up("Shift")
    r = page.evaluate(f"() => {TL}.S.range")
    assert r and r["t1"] > r["t0"]
    page.click("#tl-flows")
    page.wait_for_function(f"() => {TL}.flowsOf(0) !== null")
    f = page.evaluate(f"() => {TL}.flowsOf(0)")
    # every arrow ends at GPU work overlapping the range
    assert all(e > r["t0"] and s < r["t1"] for s, e in zip(f["to_start"], f["to_end"]))


def test_kernel_names_stay_distinct_when_shortened(page, gpt2_app, ddp_app):
    names = sorted({k.name for app in (gpt2_app, ddp_app) for rt in app.data.capture.ranks for k in kernel_stats(rt)})
    open_page(page, gpt2_app.url, "overview")
    labels = page.evaluate("(n) => window.__aiprof.fmt.kernelLabels(n, 56)", names)
    assert len(set(labels)) == len(names)  # two different kernels never read the same
    short = page.evaluate("(n) => n.map(x => window.__aiprof.fmt.elide(window.__aiprof.fmt.kernelName(x), 56))", names)
    for full, s in zip(names, short):
        assert len(s) <= 56 + 16  # at most a token longer than asked
        clean = page.evaluate("(x) => window.__aiprof.fmt.kernelName(x)", full)
        if "<" in clean and len(clean) > 56:
            assert s.startswith(clean[:clean.index("<") + 1] + "…")  # the kernel's own name stays
            assert clean.endswith(s.split("…", 1)[1])  # then the end of its template arguments
    # templated kernels lose their noise, not what they are
    k = page.evaluate("(x) => window.__aiprof.fmt.kernelName(x)",
                      "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
                      "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
    assert k == "vectorized_elementwise_kernel<4, CUDAFunctor_add<BFloat16>>"
    k = page.evaluate("(x) => window.__aiprof.fmt.kernelName(x)",
                      "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
                      "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)")
    assert k == "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8"
