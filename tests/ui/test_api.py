"""The UI's JSON API on the real fixtures: bounded answers, clear 4xx, numbers from the report."""
from __future__ import annotations

import numpy as np
import pytest

from tests.deps import need

need("starlette")
from starlette.testclient import TestClient  # noqa: E402

from aiprof.server.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def client(gpt2_app):
    return TestClient(create_app(gpt2_app.data))


def test_bad_requests_are_4xx(client):
    assert client.get("/api/overview?rank=9").status_code == 404
    assert client.get("/api/diff?rank=0&base=2").status_code == 400  # missing compare
    r = client.get("/api/diff?rank=0&base=2&compare=99")
    assert r.status_code == 400 and "no step 99" in r.json()["error"]
    assert client.get("/api/timeline/window?rank=0&t0=10&t1=5").status_code == 400
    assert client.get("/api/timeline/window?rank=0&t0=0&t1=5&px=100000").status_code == 400
    assert client.get("/api/kernels?rank=0&limit=abc").status_code == 400
    assert client.get("/api/timeline/event?rank=0&source=bogus&row=0").status_code == 400
    assert client.get("/api/timeline/event?rank=0&source=kernels&row=99999999").status_code == 404
    assert client.get("/api/timeline/next?rank=0&source=bogus&row=0").status_code == 400
    assert client.get("/api/timeline/flows?rank=0&t0=5&t1=5").status_code == 400
    assert client.get("/api/timeline/flows?rank=0&t0=0&t1=5&limit=0").status_code == 400
    assert client.get("/api/timeline/collectives?t0=9&t1=1").status_code == 400
    assert client.get("/api/nothing").status_code == 404


def test_overview_numbers_are_the_reports(client, gpt2_app):
    rr = gpt2_app.report["ranks"][0]
    ov = client.get("/api/overview?rank=0&k=5").json()
    assert ov["summary"]["step_median_us"] == pytest.approx(rr["summary"]["step_median_us"])
    assert [k["name"] for k in ov["kernels"]["by_time"]["top"]] == [k["name"] for k in rr["top_kernels"][:5]]
    # top 5 by launches is its own list (not the top by time), and "other" holds the rest
    by_calls = ov["kernels"]["by_calls"]
    assert [k["name"] for k in by_calls["top"]] == [k["name"] for k in rr["kernels_by_calls"]["top"][:5]]
    assert [k["calls"] for k in by_calls["top"]] == sorted((k["calls"] for k in by_calls["top"]), reverse=True)
    assert sum(k["calls"] for k in by_calls["top"]) + by_calls["other"]["calls"] == rr["rows"]["kernels"]
    assert by_calls["top"][0]["calls"] >= max(k["calls"] for k in rr["top_kernels"])
    assert ov["kernels"]["launches"] == rr["rows"]["kernels"]
    assert sum(ov["step_hist"]["counts"]) == len(rr["steps"]) == 5
    assert ov["precision_us"] == rr["kernels"]["kernel_precision_us"]
    assert ov["activity"] == rr["activity"] and set(ov["activity"]) == {"kernels", "memcpy", "memset"}
    assert ov["hw"]["file"] is None  # the fixture has no hw.csv: the UI must say so, not invent it


def test_timeline_window_is_bounded_by_pixels(client, gpt2_app):
    lanes = client.get("/api/timeline/lanes?rank=0").json()
    full = client.get(f"/api/timeline/window?rank=0&t0={lanes['start']}&t1={lanes['end']}&px=400").json()
    drawn = sum(len(l["events"]["start"]) for l in full["lanes"])
    assert drawn < lanes["events"] / 10  # a summary, not the trace
    assert any("summary" in l for l in full["lanes"])
    # every event sent for a dense lane is at least one pixel wide
    for l in full["lanes"]:
        if "summary" in l:
            w = np.array(l["events"]["end"]) - np.array(l["events"]["start"])
            assert (w >= full["bucket_ns"]).all()
    # zoomed into 1 ms: every event there is sent, each exactly as in the table
    t0 = lanes["start"] + 60_000_000
    z = client.get(f"/api/timeline/window?rank=0&t0={t0}&t1={t0 + 1_000_000}&px=1000").json()
    gpu = [l for l in lanes["lanes"] if l["group"] == "gpu" and l["kind"] == "kernels / memcpy"][0]["id"]
    g = [l for l in z["lanes"] if l["id"] == gpu][0]
    k = gpt2_app.data.rank(0).kernels
    o = gpt2_app.data.origin()
    s, e = k["ts"] - o, k["ts"] + k["dur"] - o
    inside = np.nonzero((e > t0) & (s < t0 + 1_000_000))[0]
    rows = [r for r, src in zip(g["events"]["row"], g["events"]["source"]) if lanes["sources"][src] == "kernels"]
    assert sorted(rows) == inside.tolist()


def test_search_and_event_links(client, gpt2_app):
    res = client.get("/api/timeline/search?rank=0&q=function sleep").json()
    assert res["total"] == 1 and res["events"][0]["source"] == "python"
    # a kernel's launch and launching op, checked against the tables directly
    rt = gpt2_app.data.rank(0)
    k, r, ops = rt.kernels, rt.runtime, rt.ops
    i = int(np.argmax(k["dur"]))
    d = client.get(f"/api/timeline/event?rank=0&source=kernels&row={i}").json()
    lr = int(np.nonzero(r["corr"] == k["corr"][i])[0][0])
    assert d["launch"]["row"] == lr and d["launch"]["name"] == r["name"][lr]
    ts, tid = r["ts"][lr], r["tid"][lr]
    enc = np.nonzero((ops["tid"] == tid) & (ops["ts"] <= ts) & (ops["ts"] + ops["dur"] >= r["ts"][lr] + r["dur"][lr]))[0]
    innermost = enc[np.argmin(ops["dur"][enc])]
    assert d["op"]["name"] == ops["name"][innermost] == "aten::mm"
    assert d["stack"][0]["kind"] == "python"


def test_links_python_to_kernels(client):
    u = client.get("/api/links?rank=0&kind=python&name=gpt_train.py(22): get_batch").json()
    assert u["calls"] == 5 and u["kernels"] == []  # get_batch launches no GPU work
    t = client.get("/api/links?rank=0&kind=python&name=gpt_train.py(29): train_step").json()
    assert t["calls"] == 5 and any(x["name"] == "aten::mm" for x in t["ops"]) and t["kernels"]


def test_overview_shows_the_stragglers_cause_on_the_waiting_rank(ddp_app):
    """The straggler cause lives on rank 1 but explains rank 0's waits: rank 0's dashboard lists it."""
    import json
    import urllib.request

    with urllib.request.urlopen(ddp_app.url + "api/overview?rank=0") as r:
        d = json.load(r)
    codes = {(c["code"], c["rank"]) for c in d["causes"]}
    assert ("STRAGGLER", 1) in codes
    assert all(c["rank"] in (0, None) or "straggler" in c["evidence"] for c in d["causes"])
    waits = [s for s in d["symptoms"] if s["code"] == "WAITING_RANK"]
    assert waits and waits[0]["rank"] == 0
    assert d["baseline"]["rank"] == 0 and d["baseline"]["replayed_step_us"] > 0


def test_flows_are_the_launch_links(client, gpt2_app):
    """Every launch -> GPU arrow of a range joins a kernel/copy to the runtime call with its
    correlation id; all GPU work overlapping the range whose launch is traced has one."""
    rt = gpt2_app.data.rank(0)
    k, r = rt.kernels, rt.runtime
    sh = gpt2_app.data.shift(0)
    lanes = client.get("/api/timeline/lanes?rank=0").json()
    t0 = lanes["start"] + 60_000_000
    f = client.get(f"/api/timeline/flows?rank=0&t0={t0}&t1={t0 + 2_000_000}&limit=5000").json()
    assert not f["truncated"] and f["total"] == len(f["to_start"]) > 0
    corr = {int(c): i for i, c in enumerate(r["corr"])}
    ks = k["ts"] + sh
    inside = np.nonzero((ks + k["dur"] > t0) & (ks < t0 + 2_000_000) & np.isin(k["corr"], r["corr"]))[0]
    kernel_arrows = [(s, e) for s, e in zip(f["to_start"], f["to_end"])
                     if any(ks[i] == s for i in inside)]
    assert len(kernel_arrows) == len(inside)
    for i in inside[:50]:
        j = f["to_start"].index(int(ks[i]))
        lr = corr[int(k["corr"][i])]
        assert f["from_start"][j] == int(r["ts"][lr]) + sh and f["from_end"][j] == int(r["ts"][lr] + r["dur"][lr]) + sh
    small = client.get(f"/api/timeline/flows?rank=0&t0={t0}&t1={t0 + 2_000_000}&limit=3").json()
    assert small["truncated"] and len(small["to_start"]) == 3 and small["total"] == f["total"]


def test_next_occurrence(client, gpt2_app):
    rt = gpt2_app.data.rank(0)
    k = rt.kernels
    names = k.strings("name")
    code = names.codes[int(np.argmax(k["dur"]))]
    rows = np.nonzero(names.codes == code)[0]
    rows = rows[np.argsort(k["ts"][rows], kind="stable")]
    nxt = client.get(f"/api/timeline/next?rank=0&source=kernels&row={rows[0]}&dir=1").json()["event"]
    assert nxt["row"] == rows[1] and nxt["source"] == "kernels"
    prv = client.get(f"/api/timeline/next?rank=0&source=kernels&row={rows[1]}&dir=-1").json()["event"]
    assert prv["row"] == rows[0]
    assert client.get(f"/api/timeline/next?rank=0&source=kernels&row={rows[-1]}&dir=1").json()["event"] is None
    # steps: the next step
    s = client.get("/api/timeline/next?rank=0&source=steps&row=0&dir=1").json()["event"]
    assert s["source"] == "steps" and s["row"] == 1


def test_collectives_across_ranks(ddp_app):
    """The matched collectives of the DDP fixture: one event per rank, the last arrival and the
    wait it caused as the cross-rank analysis counts them."""
    import json
    import urllib.request

    rep = ddp_app.report
    with urllib.request.urlopen(ddp_app.url + "api/timeline/collectives?t0=0&t1=1e13&limit=2000") as r:
        c = json.load(r)
    arr = rep["cross_rank"]["arrivals"]
    assert c["total"] == len(c["collectives"]) == arr["collectives"]
    last = {}
    for x in c["collectives"]:
        assert {p["rank"] for p in x["ranks"]} == {0, 1}
        for p in x["ranks"]:
            ev = p["event"]
            assert ev["source"] == "kernels" and ev["name"].startswith("ncclDevKernel")
            assert (ev["start"], ev["end"]) == (p["start"], p["end"])
        starts = {p["rank"]: p["start"] for p in x["ranks"]}
        assert x["last_rank"] == max(starts, key=starts.get)
        assert x["caused_us"] == pytest.approx(abs(starts[0] - starts[1]) / 1000, abs=1e-3)
        last[x["last_rank"]] = last.get(x["last_rank"], 0) + 1
    assert {str(k): v for k, v in last.items()} == {k: v for k, v in arr["last_count"].items() if v}
    assert sum(x["caused_us"] for x in c["collectives"]) == pytest.approx(sum(arr["caused_wait_us"].values()), rel=1e-6)


def test_pm_counters_are_served_under_the_gpu_with_level_of_detail(tmp_path):
    """The GPU's PM samples (recorded on an H100, tests/data/pm): listed as GPU counters, and a
    wide window comes back as at most one (mean) point per pixel."""
    import importlib.util
    from pathlib import Path

    from aiprof.analysis.counters import load_pm
    from aiprof.server.data import CaptureData
    from aiprof.trace.store import open_capture

    spec = importlib.util.spec_from_file_location(
        "pm_capture", Path(__file__).resolve().parents[1] / "analysis" / "test_counters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root, _ = mod.make_capture(tmp_path, mod._rec())
    cap = open_capture(str(root))
    c = TestClient(create_app(CaptureData(cap)))
    lanes = c.get("/api/timeline/lanes?rank=0").json()
    pmc = [x for x in lanes["counters"] if x["id"].startswith("pm:")]
    pm = load_pm(cap.ranks[0])
    assert {x["id"] for x in pmc} == {f"pm:gpu0:{m}" for m in pm.values}
    assert all(x["group"] == "gpu" for x in pmc)
    assert next(x for x in pmc if x["id"] == "pm:gpu0:pm_dram_read_Bps")["unit"] == "B/s"
    got = c.get(f"/api/timeline/counters?rank=0&t0={lanes['start']}&t1={lanes['end']}&px=100").json()["counters"]
    sm = got["pm:gpu0:pm_sm_active_pct"]
    assert 0 < len(sm["ts"]) <= 100
    assert 0 <= min(sm["value"]) and max(sm["value"]) <= 100
    assert max(sm["value"]) > 90  # the GEMM and elementwise phases kept the SMs busy


def test_kernels_table_carries_family_counters(tmp_path):
    """Each kernel row gets the PM counters of its family (recorded on an H100, tests/data/pm)."""
    import importlib.util
    from pathlib import Path

    from aiprof.server.data import CaptureData
    from aiprof.trace.store import open_capture

    spec = importlib.util.spec_from_file_location(
        "pm_capture", Path(__file__).resolve().parents[1] / "analysis" / "test_counters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root, _ = mod.make_capture(tmp_path, mod._rec())
    c = TestClient(create_app(CaptureData(open_capture(str(root)))))
    ks = c.get("/api/kernels?rank=0").json()
    assert ks["counters"] is True
    by = {r["name"][:40]: r for r in ks["rows"]}
    ew = next(r for n, r in by.items() if "elementwise" in n)
    mm = next(r for n, r in by.items() if n.startswith("nvjet"))
    assert ew["hw_bound"] == "memory" and mm["hw_bound"] == "compute"
    assert mm["hw_tensor_active_pct"] > 85 and ew["hw_dram_gbps"] > 2500
