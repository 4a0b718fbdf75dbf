"""Chrome JSON export: loadable, every slice present, GPU time preserved to the ns, flow arrows
(launch → kernel, rank → rank through collectives), and read back by `aiprof analyze` as the
same report."""
from __future__ import annotations

import gzip
import json

from aiprof.export import chrome
from aiprof.export.timeline import build_timeline


def test_chrome_json_round_trip(gpt2_cap, tmp_path):
    out = tmp_path / "t.json.gz"
    st = chrome.export(gpt2_cap, str(out))
    doc = json.loads(gzip.decompress(out.read_bytes()))
    evs = doc["traceEvents"]
    assert len(evs) == st.events
    tl = build_timeline(gpt2_cap)
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(tl.start)
    rt = gpt2_cap.ranks[0]
    gpu = [e for e in xs if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert len(gpu) == len(rt.kernels) + len(rt.memops)
    total_ns = sum(round(e["dur"] * 1000) for e in gpu)
    assert total_ns == int(rt.kernels["dur"].sum()) + int(rt.memops["dur"].sum())
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(n.startswith("GPU 0 stream") for n in names)


def test_chrome_launch_flows(gpt2_cap, tmp_path):
    """Every launch matched to its GPU work is one "s"/"f" pair (ac2g, as torch.profiler writes):
    "s" inside the CUDA call, "f" binding to the enclosing kernel ("bp": "e")."""
    out = tmp_path / "t.json"
    st = chrome.export(gpt2_cap, str(out))
    evs = json.loads(out.read_text())["traceEvents"]
    starts = {e["id"]: e for e in evs if e["ph"] == "s" and e["cat"] == "ac2g"}
    ends = {e["id"]: e for e in evs if e["ph"] == "f" and e["cat"] == "ac2g"}
    assert starts and set(starts) == set(ends) and len(ends) == st.flows
    assert all(e["bp"] == "e" for e in ends.values())
    slices = {(e["pid"], e["tid"], e["ts"]): e for e in evs if e["ph"] == "X"}
    for fid, f in list(ends.items())[:200]:
        k = slices[(f["pid"], f["tid"], f["ts"])]
        s = slices[(starts[fid]["pid"], starts[fid]["tid"], starts[fid]["ts"])]
        assert k["cat"] in ("kernel", "gpu_memcpy", "gpu_memset") and s["cat"] in ("cuda_runtime", "cuda_driver")
        assert k["args"]["correlation"] == s["args"]["correlation"]


def test_chrome_collective_flows(ddp2_cap, tmp_path):
    """Two ranks: each collective matched across them is one arrow from the first arrival to the last."""
    out = tmp_path / "d.json"
    chrome.export(ddp2_cap, str(out))
    evs = json.loads(out.read_text())["traceEvents"]
    coll = [e for e in evs if e.get("cat") == "collective"]
    s = {e["id"]: e for e in coll if e["ph"] == "s"}
    f = {e["id"]: e for e in coll if e["ph"] == "f"}
    assert s and set(s) == set(f)
    assert all(s[i]["pid"] != f[i]["pid"] for i in s)  # rank to rank
    kernels = {(e["pid"], e["tid"], e["ts"]): e["name"] for e in evs if e["ph"] == "X" and e["cat"] == "kernel"}
    assert all("nccl" in kernels[(e["pid"], e["tid"], e["ts"])].lower() for e in coll)
