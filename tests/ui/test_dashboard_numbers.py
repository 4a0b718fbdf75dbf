"""Every number the dashboard panels show, read back from the page in headless Chromium and
checked against the JSON report (the report is what the UI must show: it computes nothing).

Covered: the KPI strip, GPU active/idle, the kernel charts (top k by time and by launches, each
with its "other" bucket), the step histogram, kernel precision, GPU activity, memory operations,
the Ranks page (heat map and table), the Memory page's peak, and the causes panel (which causes,
in which order, their savings per step and shares, the symptoms each explains, the orphans and the
baseline the shares are of)."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.report import json_report
from aiprof.report.text import ALONE_SHOWN_SHARE
from tests.ui.conftest import open_page


def us(v: float) -> str:
    """web/src/fmt.js us()."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f} s"
    if a >= 1e3:
        return f"{v / 1e3:.2f} ms"
    return f"{v:.1f} µs"


def pct(v: float) -> str:
    return f"{v:.1f} %"


def nbytes(v: float) -> str:
    """web/src/fmt.js bytes()."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i, x = 0, abs(v)
    while x >= 1024 and i < len(units) - 1:
        x /= 1024
        i += 1
    return ("-" if v < 0 else "") + f"{x:.{2 if i else 0}f} {units[i]}"


def _option(page, name):
    return page.evaluate(f"() => window.__aiprof.charts[{name!r}].getOption()")


def _pie(page, name):
    return {d["name"]: d["value"] for d in _option(page, name)["series"][0]["data"]}


def _bars(page, name):
    opt = _option(page, name)
    return opt["yAxis"][0]["data"], [d["value"] for d in opt["series"][0]["data"]]


def _report(served) -> dict:
    """The report as `aiprof analyze --json` writes it (NaN -> null, numpy -> plain)."""
    import json

    return json.loads(json_report.dumps(served.report))


def _marginal(sv: dict) -> str:
    """The note beside a saving marginal to other fixes that differs from the stand-alone one by
    ALONE_SHOWN_SHARE of the step (the text report's rule), in the UI's number format."""
    before = list(dict.fromkeys(sv.get("marginal_to") or []))
    alone, step = sv.get("alone_us"), sv.get("baseline_step_us") or 0.0
    if alone is None or not before or step <= 0 or abs(alone - sv["per_step_us"]) < ALONE_SHOWN_SHARE * step:
        return ""
    return f"(once {', '.join(before)} {'is' if len(before) == 1 else 'are'} fixed; {us(alone)} alone)"


def _check_causes(page, rep: dict, rank: int) -> None:
    """The causes panel shows the rank's causes (its own, job-wide ones, and the straggler's cause
    it waits for) in the report's order, with the report's savings; its symptoms and orphans."""
    def concerns(c: dict) -> bool:
        st = c["evidence"].get("straggler")
        return c["rank"] in (None, rank) or (st is not None and rank in st["waiting_ranks"])

    want = [c for c in rep["causes"] if concerns(c)]
    codes = page.eval_on_selector_all("#causes .cause", "els => els.map(e => e.dataset.code)")
    assert codes == [c["code"] for c in want]
    texts = page.eval_on_selector_all("#causes .cause .impact", "els => els.map(e => e.innerText)")
    assert texts == [f"saves {us(c['saving']['per_step_us'])} per step · {pct(100 * c['saving']['share'])} of the step"
                     for c in want]
    # a saving marginal to other fixes that differs from the stand-alone one: both, as the text says
    notes = page.eval_on_selector_all("#causes .cause .f-head", "els => els.map(e => e.querySelector('.marginal')"
                                      " ? e.querySelector('.marginal').innerText : '')")
    assert notes == [_marginal(c["saving"]) for c in want]
    n_steps = len(next(r for r in rep["ranks"] if r["rank"] == rank)["steps"])
    items = page.eval_on_selector_all("#causes .cause .f-symptoms li", "els => els.map(e => e.innerText)")
    assert items == [f"explains {us(s['explained_us'] / n_steps)} per step of: {s['title']}"
                     + (f" (rank {s['rank']})" if s["rank"] is not None else "")
                     for c in want for s in c["symptoms"]]
    orphans = [s for s in rep["symptoms"] if s["orphan"] and s["rank"] in (None, rank)]
    assert page.locator("#orphans .finding").count() == len(orphans)
    b = next(x for x in rep["baseline"] if x["rank"] == rank)
    basis = page.inner_text("#causes-basis")
    assert us(b["replayed_step_us"]) in basis and us(b["recorded_step_us"]) in basis


def _check_overview(page, served, rank: int) -> None:
    rep = _report(served)
    rr = next(r for r in rep["ranks"] if r["rank"] == rank)
    s, ka, fl = rr["summary"], rr["kernels"], rr["flops"]
    open_page(page, served.url, f"overview?rank={rank}")
    _check_causes(page, rep, rank)
    # KPIs
    assert page.inner_text("#kpi-steps") == str(s["steps"])
    assert page.inner_text("#kpi-median") == us(s["step_median_us"])
    assert page.inner_text("#kpi-max") == us(s["step_max_us"])
    assert page.inner_text("#kpi-busy") == pct(s["gpu_busy_pct"])
    assert page.inner_text("#kpi-sync") == us(s["sync_us"])
    assert page.inner_text("#kpi-mfu") == (pct(fl["mfu_pct"]) if fl["mfu_pct"] is not None else "—")
    assert page.inner_text("#kpi-launches") == str(rr["rows"]["kernels"]) == str(rr["activity"]["kernels"]["count"])
    assert page.inner_text("#kpi-distinct") == str(rr["kernels_other"]["distinct"])
    assert page.inner_text("#kpi-ktime") == us(ka["gpu_time_us"])
    # GPU active vs idle, in steps
    active = _pie(page, "gpu-active")
    assert active["idle"] == pytest.approx(s["idle_us"])
    assert active["active"] == pytest.approx(s["duration_us"] - s["idle_us"])
    # kernels: each chart its own top k and an "other" bar; together they are all kernels
    by_time = {"top": rr["top_kernels"], "other": rr["kernels_other"]}
    for chart, t, field, total in (("kernel-time", by_time, "total_us", ka["gpu_time_us"]),
                                   ("kernel-calls", rr["kernels_by_calls"], "calls", rr["rows"]["kernels"])):
        labels, values = _bars(page, chart)
        assert values[:-1] == pytest.approx([k[field] for k in t["top"]])
        assert values[-1] == pytest.approx(t["other"][field])
        assert labels[-1] == f"other ({t['other']['kernels']} kernels)"
        assert sum(values) == pytest.approx(total)
        assert len(set(labels)) == len(labels)  # distinct kernels never read the same
    # step histogram: 10 equal bins over the report's step durations
    durs = [st["duration_us"] for st in rr["steps"]]
    counts, _ = np.histogram(durs, bins=10, range=(min(durs), max(durs) if max(durs) > min(durs) else min(durs) + 1e-9))
    assert _option(page, "step-hist")["series"][0]["data"] == counts.tolist()
    # precision of all kernel time; GPU activity; memory operations
    assert _pie(page, "precision") == pytest.approx(ka["kernel_precision_us"])
    act = _pie(page, "activity")
    assert act == pytest.approx({f"{k} ({v['count']})": v["time_us"] for k, v in rr["activity"].items()})
    assert "sync" not in " ".join(act)  # host waits are not GPU activity
    if rr["memops"]:
        mem = _pie(page, "memops")
        assert mem == pytest.approx({f"{m['name']} ×{m['count']} · {nbytes(m['bytes'])}": m["time_us"] for m in rr["memops"]})


def test_gpt2_dashboard_numbers_are_the_reports(page, gpt2_app):
    _check_overview(page, gpt2_app, 0)
    # its LAUNCH_BOUND saves more once the specific causes are fixed than alone: the note is shown
    assert "LAUNCH_BOUND" in [c["code"] for c in _report(gpt2_app)["causes"] if _marginal(c["saving"])]
    assert page.locator("#causes .cause[data-code=LAUNCH_BOUND] .marginal").count() == 1
    # the GPT-2 capture has FLOPs estimated from shapes: MFU is a number, and says how it was found
    assert "estimated from shapes" in page.inner_text("#kpi-mfu-note")
    open_page(page, gpt2_app.url, "memory")
    m = _report(gpt2_app)["ranks"][0]["memory"]
    assert page.inner_text("#mem-peak") == nbytes(m["peak_allocated_bytes"])
    assert page.locator("#no-nvml").count() == 1  # no hw.csv: the page says so


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_dashboard_numbers_are_the_reports(page, ddp_app, rank):
    _check_overview(page, ddp_app, rank)


def test_ranks_page_numbers_are_the_reports(page, ddp_app):
    rep = _report(ddp_app)
    mx = rep["cross_rank"]["matrix"]
    open_page(page, ddp_app.url, "ranks")
    opt = _option(page, "heat")
    steps = [int(x.split()[1]) for x in opt["xAxis"][0]["data"]]
    assert steps == mx["steps"]
    got = {(steps[x], rep["ranks"][y]["rank"]): v for x, y, v in opt["series"][0]["data"]}
    want = {(st, r): mx["step_us"][i][j] for i, r in enumerate(mx["ranks"]) for j, st in enumerate(mx["steps"])
            if mx["step_us"][i][j] is not None}
    assert got == pytest.approx(want)
    # the colour scale spans the values shown, in ms, not 0..max
    vm = opt["visualMap"][0]
    assert vm["min"] == pytest.approx(min(want.values())) and vm["max"] == pytest.approx(max(want.values()))
    assert vm["min"] > 0
    rows = page.locator("#rank-table tbody tr")
    for i, rr in enumerate(rep["ranks"]):
        cells = rows.nth(i).locator("td").all_inner_texts()
        s = rr["summary"]
        assert cells[0] == str(rr["rank"]) and cells[3] == str(s["steps"])
        assert cells[4:9] == [us(s["step_median_us"]), us(s["compute_us"]), us(s["communication_us"]),
                              us(s["communication_total_us"]), pct(s["gpu_busy_pct"])]
