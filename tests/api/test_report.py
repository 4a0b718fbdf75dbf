"""The report as typed objects: ``to_dict()`` is the JSON report ``aiprof analyze --json`` prints,
and a notebook shows its causes table, with the trace's names escaped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from html.parser import HTMLParser

import aiprof
from aiprof.api import Baseline, Cause, Place, RankReport, Report, Saving, Step, Symptom
from tests import hostile_trace as H
from tests.api.conftest import ROOT


def _analyze_json(*paths) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "AIPROF_PROGRESS": "never"}
    res = subprocess.run([sys.executable, "-m", "aiprof", "analyze", "--json", *map(str, paths)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_to_dict_is_the_json_report(ddp2_dir):
    paths = sorted(ddp2_dir.iterdir())
    paths = [p for p in paths if p.name.endswith(".json.gz")]
    cli = _analyze_json(*paths)
    cap = aiprof.open(paths)  # the same paths as the CLI got: the report names them
    assert json.loads(cap.report().to_json()) == cli
    assert cap.report().to_dict() == Report.from_dict(cap.report().to_dict()).to_dict()


def test_typed_fields(stall_cap):
    rep = stall_cap.report()
    assert rep.schema == "aiprof.report/2" and rep.capture.ranks_found == [0]
    assert isinstance(rep.ranks[0], RankReport) and all(isinstance(s, Step) for s in rep.ranks[0].steps)
    assert all(isinstance(c, Cause) for c in rep.causes) and all(isinstance(s, Symptom) for s in rep.symptoms)
    assert isinstance(rep.baseline[0], Baseline)
    first = rep.causes[0]
    assert isinstance(first.place, Place) and isinstance(first.saving, Saving)
    # ground truth (tests/data/README.md): get_batch slept 80 ms in step 3, the GPU idled
    assert (first.code, first.severity, first.rank) == ("DATALOADER_STARVED", "high", 0)
    assert "get_batch" in first.place.site and first.place.steps == [3]
    assert first.saving.per_step_us > 10_000 and 0 < first.saving.share < 1
    assert [s.code for s in first.symptoms][:1] == ["GPU_IDLE"]
    ids = {c.id for c in rep.causes}
    assert all(e["cause"] in ids for s in rep.symptoms for e in s.explained_by)


def test_to_dict_is_a_copy(stall_cap):
    rep = stall_cap.report()
    d = rep.to_dict()
    d["causes"][0]["place"]["stack"].clear()
    d["ranks"][0]["summary"]["idle_us"] = -1
    assert rep.causes[0].place.stack and rep.ranks[0].summary["idle_us"] > 0


def test_keys_it_does_not_type_are_kept(stall_cap):
    # the schema may add fields within a version: they go through from_dict/to_dict unchanged
    d = stall_cap.report().to_dict()
    d["new_section"] = {"a": 1}
    d["causes"][0]["new_field"] = [1, 2]
    d["ranks"][0]["steps"][0]["new_metric_us"] = 5.0
    rep = Report.from_dict(d)
    assert rep.causes[0].extra == {"new_field": [1, 2]}
    assert rep.to_dict() == d


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.titles: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.titles += [v for k, v in attrs if k == "title"]

    def handle_data(self, data):
        self.text.append(data)


def test_notebook_html_is_the_causes_table(stall_cap):
    html = stall_cap.report()._repr_html_()
    p = _Tags()
    p.feed(html)
    text = "".join(p.text)
    assert '<table class="aiprof-causes">' in html
    for c in stall_cap.report().causes:
        assert c.code in text and c.title in text and c.remedy in text
    assert "gpt_train.py(22): get_batch (steps 3)" in text


def test_names_from_the_trace_are_escaped(tmp_path):
    trace = H.write(tmp_path / "xss.json.gz", H.XSS)
    rep = aiprof.open(trace).report()
    html = rep._repr_html_()
    p = _Tags()
    p.feed(html)
    assert p.tags <= {"div", "table", "caption", "thead", "tbody", "tr", "th", "td", "code", "p"}, p.tags
    assert "<img" not in html and "<svg" not in html and "<script" not in html
    # the hostile Python frame is in a cause's stack (shown on hover): as text, intact
    stacks = [s for c in rep.causes for s in c.place.stack]
    assert H.XSS["frame"] in stacks
    assert any(H.XSS["frame"] in t for t in p.titles)


def test_no_causes_says_so():
    d = {"schema": "aiprof.report/2", "generator": {}, "capture": {"world_size": 1, "ranks_found": [0], "sources": []},
         "ranks": [], "cross_rank": None, "causes": [], "symptoms": [], "baseline": []}
    assert "none found" in Report.from_dict(d)._repr_html_()
