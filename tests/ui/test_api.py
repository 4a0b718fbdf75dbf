"""The UI's JSON API on the real fixtures: bounded answers, clear 4xx, numbers from the report."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("starlette")
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
    assert client.get("/api/nothing").status_code == 404


def test_overview_numbers_are_the_reports(client, gpt2_app):
    rr = gpt2_app.report["ranks"][0]
    ov = client.get("/api/overview?rank=0&k=5").json()
    assert ov["summary"]["step_median_us"] == pytest.approx(rr["summary"]["step_median_us"])
    assert [k["name"] for k in ov["kernels"]["top"]] == [k["name"] for k in rr["top_kernels"][:5]]
    assert ov["kernels"]["launches"] == rr["rows"]["kernels"]
    assert sum(ov["step_hist"]["counts"]) == len(rr["steps"]) == 5
    assert ov["precision_us"] == rr["kernels"]["precision_us"]
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
