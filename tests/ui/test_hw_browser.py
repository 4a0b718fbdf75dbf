"""Hardware samples in the browser: a real CPU capture (`aiprof run --what kernels,hw` over the
tiny torch example) with host samples, served by the app and checked in headless Chromium
against the store's ``hw`` table; the same for the 4-GPU H200 capture with NVML/GPM samples
(tests/data/ddp4_hw, skipped until it is there); the "not captured" states on a trace without
samples; the GPU-side annotation and sync rows of the timeline."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiprof.analysis import timeline, timeseries
from tests.ui.conftest import _serve, open_page

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cpu_hw_capture(tmp_path_factory) -> Path:
    """A 1.5 s capture of real torch training on CPU with host samples every 50 ms."""
    out = tmp_path_factory.mktemp("hwcap")
    res = subprocess.run([sys.executable, "-m", "aiprof", "run", "--what", "kernels,hw", "--hw-interval-ms", "50",
                          "--duration-ms", "1500", "--out", str(out), "--capture-id", "c", "--", sys.executable,
                          str(ROOT / "examples" / "tiny_train.py"), "--steps", "600"],
                         capture_output=True, text=True, timeout=180, check=False)
    cap = out / "c"
    assert (cap / "rank0" / "hw.csv").is_file(), f"no hw.csv: rc={res.returncode}\n{res.stderr[-2000:]}"
    return cap


@pytest.fixture(scope="session")
def hw_app(cpu_hw_capture):
    server, th, s = _serve([cpu_hw_capture])
    yield s
    server.should_exit = True
    th.join(10)


def _option(page, name):
    return page.evaluate(f"() => window.__aiprof.charts[{name!r}].getOption()")


def _weighted_mean(ts: np.ndarray, v: np.ndarray, lo: int, hi: int) -> float:
    """Independent check of analysis.timeseries.interval_mean: sample i covers (ts[i-1], ts[i]]."""
    num = den = 0.0
    for i in range(1, len(ts)):
        w = max(0, min(int(ts[i]), hi) - max(int(ts[i - 1]), lo))
        num += w * float(v[i])
        den += w
    return num / den


def test_cpu_panels_show_the_hw_table(page, hw_app):
    rt = hw_app.data.capture.ranks[0]
    h = rt.hw
    metric = np.asarray(h["metric"])
    sel = metric == "cpu_util_pct"
    ts, val = h["ts"][sel], h["value"][sel]
    assert len(ts) >= 10  # 1.5 s at 50 ms
    w = hw_app.report["ranks"][0]["window"]
    open_page(page, hw_app.url, "overview")
    # CPU active vs idle: the analysis' time-weighted mean over the window, from the hw table
    pie = {d["name"]: d["value"] for d in _option(page, "cpu-active")["series"][0]["data"]}
    expect = _weighted_mean(ts, val, w["start_ns"], w["end_ns"])
    assert pie["active"] == pytest.approx(expect) and pie["idle"] == pytest.approx(100 - expect)
    psel = metric == "proc_cpu_pct"
    proc = _weighted_mean(h["ts"][psel], h["value"][psel], w["start_ns"], w["end_ns"])
    assert page.inner_text("#cpu-proc") == f"{proc:.1f} %"
    assert expect > 20  # a training loop keeps the CPU busy
    # CPU utilisation over time: every sample, at its time after the window start; the host's
    # share of all CPUs on the left axis, the process's share of one CPU on the right one
    opt = _option(page, "cpu")
    assert [a["name"] for a in opt["yAxis"]] == ["% of all CPUs", "% of one CPU"]
    by_axis = {s["yAxisIndex"]: s for s in opt["series"]}
    cpu, prc = by_axis[0]["data"], by_axis[1]["data"]
    assert "% of all CPUs" in by_axis[0]["name"] and "% of one CPU" in by_axis[1]["name"]
    assert [p[1] for p in cpu] == pytest.approx(val.tolist())
    assert [p[0] for p in cpu] == pytest.approx(((ts - w["start_ns"]) / 1e6).tolist())
    assert [p[1] for p in prc] == pytest.approx(h["value"][psel].tolist())
    assert max(p[1] for p in prc) > 100 or opt["yAxis"][1].get("max") is None  # not capped at 100 %
    # no FLOPs in this capture (no record_shapes) and no GPU: MFU says so instead of 0 %
    fl = hw_app.report["ranks"][0]["flops"]
    assert fl["mfu_pct"] is None and fl["total_flops"] is None and fl["flops_reason"] == "shapes not recorded: add --what shapes"
    assert page.inner_text("#kpi-mfu") == "—" and fl["mfu_reason"] in page.inner_text("#kpi-mfu-note")
    assert page.inner_text("#kpi-device") == "CPU only" and page.inner_text("#kpi-busy") == "—"
    assert "No GPU samples" in page.inner_text("#p-gpu-util")  # CPU machine: no NVML, and the page says so
    # Timeline: the hardware counter tracks hold the samples (at full view every sample is a column)
    open_page(page, hw_app.url, "timeline")
    assert page.locator("#tl-nohw").count() == 0
    c = page.evaluate("() => window.__aiprof.timeline.counters(0)['hw:host:cpu_util_pct']")
    o = -hw_app.data.shift(0)
    t0, t1 = page.evaluate("() => [window.__aiprof.timeline.data(0).t0, window.__aiprof.timeline.data(0).t1]")
    inside = (ts >= t0 + o) & (ts < t1 + o)
    assert c["value"] == pytest.approx(val[inside].tolist())
    assert c["ts"] == [int(t) - o for t in ts[inside]]
    names = page.evaluate("() => window.__aiprof.timeline.L(0).counters.map(c => c.name)")
    assert {"host cpu_util_pct", "host proc_cpu_pct", "host mem_used_bytes", "host proc_rss_bytes"} <= set(names)


def test_not_captured_without_samples(page, gpt2_app):
    open_page(page, gpt2_app.url, "overview")
    assert "not captured" in page.inner_text("#cpu-active-none")
    assert "not captured" in page.inner_text("#cpu-none")
    assert "cpu-active" not in page.evaluate("() => Object.keys(window.__aiprof.charts)")


def test_gpu_annotation_rows_on_the_timeline(page, ddp_app):
    rt = ddp_app.data.capture.ranks[0]
    a = rt.annotations
    gpu_rows = np.nonzero(a["gpu"])[0]
    open_page(page, ddp_app.url, "timeline")
    lanes = page.evaluate("() => window.__aiprof.timeline.L(0).lanes")
    ann = [ln for ln in lanes if ln["kind"] == "annotations"]
    assert sum(ln["events"] for ln in ann) == len(gpu_rows)  # every GPU-side annotation has a row
    assert {ln["track"] for ln in ann} == {"GPU 0 stream 7 annotations", "GPU 0 stream 17 annotations"}
    drawn = page.evaluate("""() => { const d = window.__aiprof.timeline.data(0), ids = new Set(%s);
        return d.lanes.filter(e => ids.has(e.id)).flatMap(e => e.events.name.map(c => d.names[c])); }"""
                          % [ln["id"] for ln in ann])
    assert "nccl:all_reduce" in drawn
    # selecting one: its fields, no host stack (it runs on the GPU)
    r = int(gpu_rows[np.asarray(a["name"])[gpu_rows] == "nccl:all_reduce"][0])
    d = page.evaluate(f"() => window.__aiprof.timeline.select(0, 'annotations', {r})")
    assert d["ref"]["name"] == "nccl:all_reduce" and d["args"]["gpu"] is True and "stack" not in d
    assert page.inner_text("#tl-sel-name") == "nccl:all_reduce"


def test_gpu_sync_rows_in_the_index(gpt2_stall):
    """The fixtures have no cuda_sync events: add two to a real trace's tables and check that
    they get a sync row on their stream, linked to the host call with the same correlation id."""
    from aiprof.trace.store import open_capture
    from aiprof.trace.table import Strings, Table

    rt = open_capture([str(gpt2_stall)]).ranks[0]
    k = rt.kernels
    rt.__dict__.pop("_analysis_cache", None)
    i = int(np.argmax(k["dur"]))
    sync = Table({"ts": np.array([k["ts"][i] - 1000, k["ts"][i] + 50_000], np.int64),
                  "dur": np.array([800, 20_000], np.int64), "device": np.array([k["device"][i]] * 2, np.int64),
                  "stream": np.array([k["stream"][i]] * 2, np.int64),
                  "name": Strings(np.array([0, 1], np.int32), ["Stream Sync", "Event Sync"]),
                  "corr": np.array([k["corr"][i], -1], np.int64), "ext_id": np.full(2, -1, np.int64),
                  "pid": np.zeros(2, np.int64), "tid": np.zeros(2, np.int64),
                  "wait_stream": np.full(2, -1, np.int64), "wait_corr": np.full(2, -1, np.int64)})
    rt._tables["gpu_sync"] = sync
    tl = timeline.build_index(rt)
    info = timeline.lanes_info(tl)
    sync_lanes = [ln for ln in info if ln["kind"] == "sync"]
    assert len(sync_lanes) == 1 and sync_lanes[0]["events"] == 2
    assert sync_lanes[0]["track"] == f"GPU {k['device'][i]} stream {k['stream'][i]} sync"
    # the sync row sits right after its stream's kernel row
    work = next(ln for ln in info if ln["track"] == f"GPU {k['device'][i]} stream {k['stream'][i]}")
    assert sync_lanes[0]["id"] == work["id"] + 1
    d = timeline.event_detail(rt, tl, "gpu_sync", 0)
    assert d["ref"]["name"] == "Stream Sync" and d["ref"]["source"] == "gpu_sync"
    assert d.get("launch")  # same correlation id as the kernel's launch call


DDP4_HW = Path(os.environ.get("AIPROF_TEST_DDP4_HW") or ROOT / "tests" / "data" / "ddp4_hw")


@pytest.fixture(scope="module")
def ddp4_hw_app(tmp_path_factory):
    """The 4-GPU H200 capture with NVML/GPM samples (rank<R>/{trace.json.gz,hw.csv,meta.json})."""
    if not (DDP4_HW / "rank0" / "hw.csv").is_file():
        pytest.skip(f"no {DDP4_HW} with hardware samples")
    d = tmp_path_factory.mktemp("ddp4hw") / "cap"
    shutil.copytree(DDP4_HW, d)  # ingest writes its cache beside the traces
    server, th, s = _serve([d])
    yield s
    server.should_exit = True
    th.join(10)


def _series(rt, metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """device -> (ts, value) of one metric, straight from the store's hw table."""
    h = rt.hw
    dev, met = np.asarray(h["device"]), np.asarray(h["metric"])
    return {d: (h["ts"][(dev == d) & (met == metric)], h["value"][(dev == d) & (met == metric)])
            for d in sorted(set(dev[met == metric]))}


def test_multi_gpu_hw_samples_in_the_browser(page, ddp4_hw_app):
    app, ranks = ddp4_hw_app, ddp4_hw_app.data.capture.ranks
    assert len(ranks) == 4
    w0 = app.report["ranks"][0]["window"]
    open_page(page, app.url, "overview")
    # GPU utilisation over time: the trace's busy share of every rank, and NVML of every GPU
    series = {s["name"]: s["data"] for s in _option(page, "gpu-util")["series"]}
    nvml = [n for n in series if n.endswith("(NVML)")]
    expected = 0
    for rt in ranks:
        host = rt.meta.get("host_name", "") or "host"
        assert f"{host} rank {rt.rank} (trace)" in series
        for dev, (ts, v) in _series(rt, "gpu_util_pct").items():
            expected += 1
            got = series[f"{host} rank {rt.rank} {dev} (NVML)"]
            assert [p[1] for p in got] == pytest.approx(v.tolist())
            # on the aligned clock: each rank's clock offset relative to rank 0
            off = app.data.offset_ns(rt.rank) - app.data.offset_ns(0)
            assert [p[0] for p in got] == pytest.approx(((ts + off - w0["start_ns"]) / 1e6).tolist())
    assert len(nvml) == expected >= 4  # every rank sampled its own GPU
    # CPU: the pie and the series of rank 0's host samples
    cpu = _series(ranks[0], "cpu_util_pct")
    if cpu:
        ts, v = next(iter(cpu.values()))
        pie = {d["name"]: d["value"] for d in _option(page, "cpu-active")["series"][0]["data"]}
        assert pie["active"] == pytest.approx(_weighted_mean(ts, v, w0["start_ns"], w0["end_ns"]))
        line = next(s["data"] for s in _option(page, "cpu")["series"] if s["yAxisIndex"] == 0)
        assert [p[1] for p in line] == pytest.approx(v.tolist())
    # Timeline of rank 1: a counter track per hw metric, holding the samples (mean per column)
    rt = ranks[1]
    open_page(page, app.url, "timeline?rank=1")
    page.evaluate("() => window.__aiprof.timeline.toggle('r1:c', true)")  # counters of one of 4 ranks: closed at first
    page.wait_for_function("() => Object.keys(window.__aiprof.timeline.counters(1)).length > 0")
    ids = page.evaluate("() => window.__aiprof.timeline.L(1).counters.map(c => c.id)")
    gpu_metrics = {(d, m) for (d, m) in timeseries.load_hw(rt).series if d.startswith("gpu")}
    assert {f"hw:{d}:{m}" for d, m in gpu_metrics} <= set(ids)
    view = page.evaluate("() => { const d = window.__aiprof.timeline.data(1); return [d.t0, d.t1, d.px]; }")
    o = -app.data.shift(1)
    for d, m in sorted(gpu_metrics)[:6]:
        ts, v = timeseries.load_hw(rt).series[(d, m)]
        c = page.evaluate(f"() => window.__aiprof.timeline.counters(1)['hw:{d}:{m}']")
        inside = (ts >= view[0] + o) & (ts < view[1] + o)
        if inside.sum() <= view[2]:  # fewer samples than pixel columns: every sample as it is
            assert c["value"] == pytest.approx(v[inside].tolist()) and c["ts"] == (ts[inside] - o).tolist()


def test_memory_page_shows_nvml_memory(page, ddp4_hw_app):
    """The 4-GPU capture has no profile_memory events but NVML samples: the Memory page draws
    the GPU's used memory (and the host's) and names its peak, from the store's hw table."""
    app = ddp4_hw_app
    rt = app.data.capture.ranks[2]
    w = app.report["ranks"][2]["window"]
    open_page(page, app.url, "memory?rank=2")
    assert page.locator("#no-memory").count() == 1  # no allocator events in this trace...
    series = {s["name"]: s["data"] for s in _option(page, "memory-hw")["series"]}
    for dev, (ts, v) in _series(rt, "mem_used_bytes").items():
        inside = (ts >= w["start_ns"]) & (ts <= w["end_ns"])
        assert inside.sum() > 5
        got = series[f"{dev} used (NVML)" if dev.startswith("gpu") else f"{dev} used"]
        assert [p[1] for p in got] == pytest.approx(v[inside].tolist())  # fewer samples than columns: all of them
        peak = page.inner_text(f"#nvml-kpis b[data-series='{dev} used']")
        assert peak == _bytes(float(v[inside].max()))
    assert any(n.startswith("gpu") for n in series) and "host process RSS" in series


def _bytes(v: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i, x = 0, abs(v)
    while x >= 1024 and i < len(units) - 1:
        x /= 1024
        i += 1
    return f"{x:.{2 if i else 0}f} {units[i]}"
