"""A report of many ranks keeps the tables of the ranks its diagnosis names only (issue 34: per-rank
detail out of the job report); the others are brief, and the UI computes their tables on demand.

The job: 17 ranks (one more than pipeline.DETAIL_RANKS) built as bench/scale.py builds its
captures, from the real 4-rank H200 DDP job (tests/data/ddp4_slow2_*), its straggler at rank 14.
"""
from __future__ import annotations

import importlib.util
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from aiprof.analysis.report import DETAIL_FIELDS, brief, is_brief, rank_section
from aiprof.diagnosis.job import JOINT_MAX_RANKS
from aiprof.pipeline import DETAIL_RANKS, build_report
from aiprof.pipeline.stages import detail_ranks
from aiprof.report.text import render
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files, open_capture

ROOT = Path(__file__).resolve().parents[2]
N_RANKS = DETAIL_RANKS + 1


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> tuple[list[str], int, dict, dict]:
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    bench_scale = sys.modules["bench_scale"] = importlib.util.module_from_spec(spec)  # its pool pickles by name
    spec.loader.exec_module(bench_scale)
    d, straggler = bench_scale.build("ddp4", N_RANKS, tmp_path_factory.mktemp("many"), procs=2)
    files = find_trace_files([str(d)])
    with engines.SerialEngine() as eng:
        rep = build_job_report(files, eng)
    return files, straggler, rep, eng.stats.by_phase


def test_only_the_named_ranks_keep_their_tables(many):
    files, straggler, rep, _ = many
    keep = rep["capture"]["detail_ranks"]
    named = {c["rank"] for c in rep["causes"] if c.get("rank") is not None}
    base = rep["cross_rank"]["stragglers"][0]["base_rank"]
    assert keep[:2] == [straggler, base]  # the straggler first, then the rank it is compared with
    assert set(keep) == (named | {straggler, base, 0}) and len(keep) < N_RANKS
    for r in rep["ranks"]:
        assert is_brief(r) == (r["rank"] not in keep)
        assert r["steps"] and r["summary"] and r["window"]  # what the rank list and the comparison read
        if is_brief(r):
            assert not set(DETAIL_FIELDS) & r.keys()
    full = sum(len(json.dumps(r)) for r in rep["ranks"] if not is_brief(r)) / len(keep)
    brief = sum(len(json.dumps(r)) for r in rep["ranks"] if is_brief(r)) / (N_RANKS - len(keep))
    assert brief < full / 4  # the tables are most of a section


def test_only_the_kept_ranks_tables_are_computed(many):
    """The analysis of a rank of a report of many ranks computes its section without the tables;
    the ranks the report keeps whole get theirs afterwards (scale.tasks.rank_tables). The report
    is the one computing every rank's tables gave: a kept rank's section is its whole section,
    a brief one is the whole section less its tables."""
    files, _, rep, phases = many
    keep = rep["capture"]["detail_ranks"]
    assert phases["tables"]["tasks"] == len(keep) and phases["analyse"]["tasks"] == N_RANKS
    cap = open_capture(files)
    by_rank = {rt.rank: rt for rt in cap.ranks}
    for r in (keep[0], next(x["rank"] for x in rep["ranks"] if is_brief(x))):
        whole = asdict(rank_section(by_rank[r])[0])
        lean = asdict(rank_section(by_rank[r], tables=False)[0])
        assert brief(lean) == brief(whole) and lean["hotspots"]["classes"] == whole["hotspots"]["classes"]
        assert not lean["top_kernels"] and lean["roofline"] is None and lean["step_diff"] is None
        assert rep["ranks"][r] == (whole if r in keep else brief(whole))


def test_detail_ranks_order_and_bound():
    cross = {"stragglers": [{"straggler_rank": 9, "base_rank": 2}], "flags": {"5": ["abnormal"], "3": ["waiting"]}}
    diag = {"causes": [{"rank": 7}, {"rank": None}, {"rank": 9}, {"rank": 99}], "minor": [{"rank": 4}]}
    assert detail_ranks(list(range(20)), cross, diag) == [9, 2, 7, 5, 0]  # minor causes name no rank
    assert detail_ranks(list(range(20)), cross, diag, most=3) == [9, 2, 7]
    assert detail_ranks([3, 4], None, {}) == [3]  # nothing named: the lowest rank


def test_text_report_shows_the_named_ranks(many):
    _, straggler, rep, _ = many
    buf = io.StringIO()
    render(rep, buf)
    text = buf.getvalue()
    assert f"Rank {straggler} · " in text
    shown = rep["capture"]["detail_ranks"][:8]  # the text report's sections: at most 8
    assert all(f"Rank {r} · " in text for r in shown)
    assert f"({N_RANKS - len(shown)} more ranks: the JSON report has every rank's steps" in text


def test_small_jobs_keep_every_table(ddp4_dir):
    rep = build_report(open_capture(find_trace_files([str(ddp4_dir)])))
    assert "detail_ranks" not in rep["capture"] and not any(is_brief(r) for r in rep["ranks"])


def test_ui_and_api_read_a_brief_rank(many):
    """The UI computes a brief rank's tables from its store when asked (the same section the
    rank's own analysis gives); the Python API reads and writes the report unchanged."""
    pytest.importorskip("starlette")
    from aiprof.api.report import Report
    from aiprof.server.data import CaptureData

    files, _, rep, _ = many
    r = next(x["rank"] for x in rep["ranks"] if is_brief(x))
    data = CaptureData(open_capture(files), report=rep)
    got = data.rank_detail(r)
    alone = build_report(open_capture([files[r]]))["ranks"][0]  # the rank analysed by itself
    for k in DETAIL_FIELDS:
        assert got[k] == alone[k], k
    ov = data.overview(r)
    assert ov["precision_us"] and ov["steps"]
    assert data.steps(r)["default_diff"] == alone["step_diff"]
    typed = Report.from_dict(rep)
    assert typed.ranks[r].brief and typed.ranks[r].top_kernels is None and not typed.ranks[0].brief
    assert typed.to_dict() == rep
    assert asdict(typed)["ranks"][r]["hotspots"] is None


def test_in_process_reports_of_many_ranks_are_the_job_paths(many):
    """Above JOINT_MAX_RANKS the joint replay does not run: pipeline.build_report then priced every
    rank alone and left the straggler unpriced ("Nothing to fix" on a 64-rank job whose straggler
    costs half its step on the Ray path). `aiprof analyze --engine local`, the UI and the Python
    API make the report the Ray path makes (scale.job_report.capture_report)."""
    from aiprof.api.capture import open as api_open
    from aiprof.scale.job_report import capture_report
    from aiprof.server.data import CaptureData

    files, straggler, rep, _ = many
    assert N_RANKS > JOINT_MAX_RANKS
    top = rep["causes"][0]
    assert top["code"] == "STRAGGLER" and top["rank"] == straggler
    got = capture_report(open_capture(files))
    assert got["causes"] == rep["causes"] and got["ranks"] == rep["ranks"] and got["verdict"] == rep["verdict"]
    # every rank's tables where the caller asks for them (the UI's and the API's report)
    ui = CaptureData(open_capture(files)).report()
    assert ui["causes"] == rep["causes"] and not any(is_brief(r) for r in ui["ranks"])
    assert api_open(files).report().causes[0].code == "STRAGGLER"
