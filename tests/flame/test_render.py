"""Renderers: folded round trip, SVG structure and colours, speedscope, py-spy input."""
from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from aiprof.flame import folded, pyspy, speedscope, stacks, svg
from aiprof.flame.profile import Profile, diff

DATA = Path(__file__).parents[1] / "data"
NS = "{http://www.w3.org/2000/svg}"


def test_folded_round_trip_keeps_every_stack_and_weight(gpt2_cap, gpt2_forest):
    p = stacks.gpu_profile(gpt2_cap.ranks[0], forest=gpt2_forest)
    buf = io.StringIO()
    assert folded.write(p, buf) == len(p.stacks)
    back = folded.read(io.StringIO(buf.getvalue()))
    clean = {tuple(folded.clean_frame(f) for f in s): w for s, w in p.as_dict().items()}
    assert back.as_dict() == clean
    assert back.total == p.total


def test_folded_differential_has_two_counts():
    a = Profile("a", [("x", "y"), ("x", "z")], np.array([5, 7]))
    b = Profile("b", [("x", "y"), ("x", "w")], np.array([9, 1]))
    d = diff(a, b)
    text = "".join(l + "\n" for l in folded.lines(d))
    assert "x;y 5 9\n" in text and "x;z 7 0\n" in text and "x;w 0 1\n" in text
    back = folded.read(io.StringIO(text))
    assert back.is_diff and back.as_dict()[("x", "y")] == 9


def _frames(svg_text: str) -> list[ET.Element]:
    root = ET.fromstring(svg_text)
    return [g for g in root.iter(NS + "g") if g.get("class") == "f"]


def test_svg_frames_nest_and_are_coloured_by_kind(ddp2_cap):
    p = stacks.build(ddp2_cap, "gpu", rank=0)
    text = svg.render_svg(p)
    frames = _frames(text)
    root = [g for g in frames if g.get("data-d") == "0"]
    assert len(root) == 1 and int(root[0].get("data-w")) == p.total
    kinds = {g.get("data-k") for g in frames}
    assert {"python", "op", "runtime", "gpu", "memory", "communication"} <= kinds
    comm = [g for g in frames if g.get("data-k") == "communication"]
    assert all("nccl" in g.find(NS + "title").text.lower() for g in comm)
    fill = {g.get("data-k"): g.find(NS + "rect").get("fill") for g in frames}
    assert len({fill[k] for k in ("gpu", "memory", "communication", "runtime", "python")}) == 5
    # a frame lies within its parent's span one level down
    by_depth: dict[int, list[tuple[int, int]]] = {}
    for g in frames:
        by_depth.setdefault(int(g.get("data-d")), []).append((int(g.get("data-x")), int(g.get("data-w"))))
    for d, spans in by_depth.items():
        if d == 0:
            continue
        parents = by_depth[d - 1]
        for x, w in spans:
            assert any(px <= x and x + w <= px + pw for px, pw in parents)
    assert "aiprofFlame" in text and "Search" in text


def test_html_holds_one_graph_per_profile(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    page = svg.render_html([stacks.gpu_profile(rt, forest=gpt2_forest), stacks.cpu_profile(rt, forest=gpt2_forest)])
    assert page.count("<svg ") == 2 and page.count("<script>") == 1
    assert "get_batch" in page


def test_diff_svg_colours_growth_red(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    d = diff(stacks.cpu_profile(rt, step=2, forest=gpt2_forest), stacks.cpu_profile(rt, step=3, forest=gpt2_forest))
    frames = _frames(svg.render_svg(d))
    sleep = [g for g in frames if g.find(NS + "text").text == "<built-in function sleep>"]
    assert sleep
    fill = sleep[0].find(NS + "rect").get("fill")
    r, g, b = (int(v) for v in fill[4:-1].split(","))
    assert r == 255 and g < 120 and b < 120  # the biggest growth is deep red


def test_speedscope_document(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    profs = [stacks.gpu_profile(rt, forest=gpt2_forest), stacks.cpu_profile(rt, forest=gpt2_forest)]
    doc = json.loads(json.dumps(speedscope.document(profs)))
    assert doc["$schema"].startswith("https://www.speedscope.app/")
    nframes = len(doc["shared"]["frames"])
    for p, sp in zip(profs, doc["profiles"]):
        assert sp["type"] == "sampled" and sp["unit"] == "nanoseconds"
        assert sum(sp["weights"]) == sp["endValue"] == p.total
        assert all(0 <= i < nframes for s in sp["samples"] for i in s)


def test_pyspy_raw_and_speedscope_outputs():
    """Files written by py-spy 0.4 (`record --format raw|speedscope`) on tests/data/pyspy_spin.py."""
    raw = pyspy.read(str(DATA / "pyspy_spin.raw"))
    assert raw.unit == "samples" and raw.total == 171  # py-spy printed "Samples: 171"
    ft = raw.frame_totals()
    assert ft["inner (spin.py:4)"] == 120 and ft["outer (spin.py:9)"] == 167
    sc = pyspy.read(str(DATA / "pyspy_spin.speedscope.json"))
    assert sc.total == 147  # "Samples: 147"
    # one root per thread, then <module> (samples with no Python frame stop at the thread)
    assert len({s[0] for s in sc.stacks}) == 1
    assert all(s[1] == "<module> (spin.py:10)" for s in sc.stacks if len(s) > 1)
    assert "inner (spin.py:4)" in sc.frame_totals()


def test_pyspy_dumps_from_aiprof_stacks():
    dumps = [{"pid": 7, "ok": True, "threads": [{"name": "MainThread", "os_thread_id": 7, "frames": [
        {"function": "inner", "file": "/x/a.py", "line": 4}, {"function": "main", "file": "/x/a.py", "line": 9}]}]}] * 3
    p = pyspy.from_dumps(dumps)
    assert p.as_dict() == {("pid 7 MainThread 7", "main (a.py:9)", "inner (a.py:4)"): 3}
