"""One source for each number: the steps table (text), the causes and symptoms, the JSON and the
UI show the same facts, on the `make demo` capture and on the committed fixtures.

Checked per capture: the text steps table's "data loading" is each step's `dataloader_us`;
DATALOADER_STARVED's per-step loading is that same figure, and the amounts its title names are
those steps' figures; the GPU_IDLE symptom's split holds host classes only and adds up to the
idle time, its data-loading part within the steps' data loading; FLOPs and MFU are a number or
null with a reason, and the text shows "—" with that reason, never 0; the device line says
"CPU only" for a capture with no GPU. In headless Chromium (as test_dashboard_numbers.py does):
the Steps page's "data loading" of every step, and the overview's device and MFU.
"""
from __future__ import annotations

import io
import json
import re
import shutil
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from aiprof.analysis.hotspots import HOST_CLASSES
from aiprof.diagnosis.causes.common import ms as cause_ms
from aiprof.report import json_report
from aiprof.report.text import render
from aiprof.server.data import CaptureData
from aiprof.trace.store import open_capture
from tests.ui.conftest import _serve, open_page

DATA = Path(__file__).resolve().parents[1] / "data"
# Every committed capture under tests/data that is a training or serving trace (single files, sets
# of rank files, capture folders), and the diagnosis fixture of the data-loading fault.
FIXTURES = {
    "gpt2_train_stall": ["gpt2_train_stall.json.gz"],
    "gpt2_attach_light": ["gpt2_attach_light_h200.json.gz"],
    "ddp2_slow1": ["ddp2_slow1_rank0.json.gz", "ddp2_slow1_rank1.json.gz"],
    "ddp4_slow2": [f"ddp4_slow2_rank{r}.json.gz" for r in range(4)],
    "ddp4_hw": ["ddp4_hw"],
    "native_ddp2_h200": ["native_ddp2_h200"],
    "nvlink_pm_h200x2": ["nvlink_pm_h200x2"],
    "sockets_pm_h200x2": ["sockets_pm_h200x2"],
    "dataloader_starved_fault": ["diagnosis/dataloader_starved_fault.json.gz"],
}
WIDTH = 220  # wide enough that no steps-table cell wraps
UNKNOWN = "—"


def _copy(tmp: Path, names: list[str]) -> list[Path]:
    out = []
    for n in names:
        src, dst = DATA / n, tmp / Path(n).name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        out.append(dst)
    return out


def _ms(us: float) -> str:
    """report/text.py _ms()."""
    return f"{us / 1000.0:,.2f}"


def _fixed(v: float, digits: int) -> str:
    """JavaScript's Number.prototype.toFixed: a tie of the exact binary value rounds up (Python's
    format rounds it to even: 145.25 µs is "145.2" here, "145.3" in the browser)."""
    return str(Decimal(v).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _ui_us(v: float) -> str:
    """web/src/fmt.js us()."""
    a = abs(v)
    return f"{_fixed(v / 1e6, 2)} s" if a >= 1e6 else f"{_fixed(v / 1e3, 2)} ms" if a >= 1e3 else f"{_fixed(v, 1)} µs"


def _steps_tables(text: str) -> list[dict[int, dict[str, str]]]:
    """Every steps table of the text report: {step: {column: cell}}, in rank order."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("Steps ("):
            continue
        cols = [c.strip() for c in lines[i + 1].split("┃")]
        rows = {}
        for row in lines[i + 3:]:
            if "│" not in row:
                break
            cells = [c.strip() for c in row.split("│")]
            rows[int(cells[0])] = dict(zip(cols, cells))
        out.append(rows)
    return out


def _analyse(paths: list[Path]) -> tuple[dict, str]:
    """The report as the JSON writes it, and the text report of the same analysis."""
    rep = CaptureData(open_capture([str(p) for p in paths])).report()
    buf = io.StringIO()
    render(rep, buf, width=WIDTH)
    return json.loads(json_report.dumps(rep)), buf.getvalue()


def check_consistent(rep: dict, text: str) -> None:
    ranks = {r["rank"]: r for r in rep["ranks"]}
    for c in rep["causes"]:
        if c["code"] != "DATALOADER_STARVED":
            continue
        steps = {s["step"]: s["dataloader_us"] for s in ranks[c["rank"]]["steps"]}
        ev = c["evidence"]
        # the cause's loading per step is the steps table's data loading
        assert {int(k): v for k, v in ev["per_step_loading_us"].items()} == pytest.approx(steps)
        assert ev["loading_us_per_step"] == pytest.approx(sum(steps.values()) / len(steps))
        for s in ev["stall_steps"]:
            assert steps[s] >= 3 * sorted(steps.values())[len(steps) // 2]
        worst = re.search(r": (\S+ \S+) in step (\d+), against", c["title"])
        if worst:  # the stall's amount in the title is that step's data loading
            assert worst.group(1) == cause_ms(steps[int(worst.group(2))] * 1e3)
    for s in rep["symptoms"]:
        if s["code"] != "GPU_IDLE":
            continue
        by = s["detail"]["by_host_class_us"]
        # GPU idle split by what the host did: host classes only, adding up to the idle time
        assert set(by) <= set(HOST_CLASSES), set(by) - set(HOST_CLASSES)
        assert sum(by.values()) == pytest.approx(s["us"], rel=1e-6)
        loading = sum(st["dataloader_us"] for st in ranks[s["rank"]]["steps"])
        assert by.get("host: data loading", 0.0) <= loading * (1 + 1e-9) + 1e-3
    tables = _steps_tables(text)
    assert len(tables) == min(len(rep["ranks"]), 8)
    for r, table in zip(rep["ranks"], tables):
        # the steps table shows each step's data loading from the report
        assert {s: row["data loading"] for s, row in table.items()} == \
            {s["step"]: _ms(s["dataloader_us"]) for s in r["steps"]}, f"rank {r['rank']}"
        assert r["summary"]["dataloader_us"] == pytest.approx(sum(s["dataloader_us"] for s in r["steps"]))
        # the device line
        kind = r["device"].get("kind")
        assert kind in ("cpu", "gpu"), r["device"]
        label = "CPU only" if kind == "cpu" else r["device"]["name"] or "GPU (model not recorded)"
        assert f"Rank {r['rank']} · {label} · " in text and "unknown device" not in text
        # FLOPs and MFU: a number, or null with its reason shown beside "—"
        fl = r["flops"]
        if fl["total_flops"] is None:
            assert fl["flops_reason"] and all(s["flops"] is None and s["mfu_pct"] is None for s in fl["per_step"])
            assert f"FLOPs {UNKNOWN} ({fl['flops_reason']})" in text
        else:  # a count: never a 0 that stands for "not recorded"
            assert fl["total_flops"] > 0 and fl.get("flops_reason") is None
        if fl["mfu_pct"] is None:
            assert fl["mfu_reason"] and f"MFU {UNKNOWN}" in text


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """Reports and text reports of every fixture (computed once for the module)."""
    memo = {}

    def get(name: str, paths: list[Path] | None = None):
        if name not in memo:
            memo[name] = _analyse(paths or _copy(tmp_path_factory.mktemp(name), FIXTURES[name]))
        return memo[name]
    return get


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_numbers_agree(analysed, name):
    check_consistent(*analysed(name))


def test_demo_numbers_agree(analysed, demo_capture):
    rep, text = analysed("demo", [demo_capture])
    check_consistent(rep, text)
    r = rep["ranks"][0]
    steps = {s["step"]: s["dataloader_us"] for s in r["steps"]}
    # the demo's fault: step 7 sleeps 60 ms in get_batch; the table and the cause say so alike
    assert steps[7] > 50_000 and max(steps, key=steps.get) == 7
    top = rep["causes"][0]
    assert top["code"] == "DATALOADER_STARVED" and top["place"]["steps"] == [7]
    assert "Rank 0 · CPU only · " in text
    assert r["flops"]["flops_reason"] == "shapes not recorded: add --what shapes"
    assert "FLOPs — (shapes not recorded: add --what shapes)" in text


@pytest.mark.parametrize("name", ["demo", "gpt2_train_stall"])
def test_ui_shows_the_same_numbers(page, demo_capture, tmp_path, name):
    """The UI (server/data.py + web/) shows the report's data loading per step, device and MFU."""
    paths = [demo_capture] if name == "demo" else _copy(tmp_path, FIXTURES[name])
    server, th, served = _serve(paths)
    try:
        rep = json.loads(json_report.dumps(served.report))
        r = rep["ranks"][0]
        open_page(page, served.url, "steps?rank=0")
        for i, s in enumerate(r["steps"]):
            page.evaluate(f"() => {{ const s = document.querySelector('#step-slider'); s.value = {i};"
                          " s.dispatchEvent(new Event('input')); }")
            kpis = page.eval_on_selector_all("#step-detail .kpi", "els => els.map(e => [e.querySelector('span')"
                                             ".innerText, e.querySelector('b').innerText])")
            assert dict(kpis)["data loading"] == _ui_us(s["dataloader_us"]), s["step"]
        open_page(page, served.url, "overview?rank=0")
        kind = r["device"]["kind"]
        assert page.inner_text("#kpi-device") == ("CPU only" if kind == "cpu" else r["device"]["name"])
        fl = r["flops"]
        if fl["mfu_pct"] is None:
            assert page.inner_text("#kpi-mfu") == UNKNOWN and fl["mfu_reason"] in page.inner_text("#kpi-mfu-note")
    finally:
        server.should_exit = True
        th.join(10)
