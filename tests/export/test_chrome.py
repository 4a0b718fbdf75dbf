"""Chrome JSON export: loadable, every slice present, GPU time preserved to the ns."""
from __future__ import annotations

import gzip
import json

from aiprof.export import chrome
from aiprof.export.timeline import build_timeline


def test_chrome_json_round_trip(gpt2_cap, tmp_path):
    out = tmp_path / "t.json.gz"
    n = chrome.export(gpt2_cap, str(out))
    doc = json.loads(gzip.decompress(out.read_bytes()))
    evs = doc["traceEvents"]
    assert len(evs) == n
    tl = build_timeline(gpt2_cap)
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(tl.start)
    rt = gpt2_cap.ranks[0]
    gpu = [e for e in xs if e["cat"] in ("kernels", "memops")]
    assert len(gpu) == len(rt.kernels) + len(rt.memops)
    total_ns = sum(round(e["dur"] * 1000) for e in gpu)
    assert total_ns == int(rt.kernels["dur"].sum()) + int(rt.memops["dur"].sum())
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(n.startswith("GPU 0 stream") for n in names)
