"""Issue 18, item 3: every analysis accepts every subset of tables.

Real captures (GPT-2 on one H200 with Python frames and memory events; 4-rank DDP with NCCL
collectives and hardware samples) with tables taken away: each table alone, each table missing,
and random subsets. Every entry point must still answer: the report (text and JSON), the UI's
timeline, the Chrome export and the flame graphs. And the input that showed the crash: a
GPU-only export (kernels, no CUDA runtime events) read by the trace reader.
"""
from __future__ import annotations

import copy
import gzip
import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiprof.pipeline import build_report
from aiprof.trace.builder import TABLES, empty_table
from aiprof.trace.store import Capture, RankTrace, open_capture
from tests.conftest import DATA
from tests.fuzz.inputs import every_entry_point


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Capture]:
    d = tmp_path_factory.mktemp("subsets")
    shutil.copy(DATA / "gpt2_train_stall.json.gz", d / "gpt2.json.gz")
    shutil.copytree(DATA / "ddp4_hw", d / "ddp4_hw")
    caps = {"gpt2": open_capture(str(d / "gpt2.json.gz")), "ddp4_hw": open_capture(str(d / "ddp4_hw"))}
    for cap in caps.values():  # load every table once; subsets share them
        for rt in cap.ranks:
            for t in TABLES:
                rt.table(t)
    assert len(caps["gpt2"].ranks[0].table("memory")) and len(caps["gpt2"].ranks[0].table("python"))
    assert len(caps["ddp4_hw"].ranks[0].table("collectives")) and len(caps["ddp4_hw"].ranks[0].table("hw"))
    return caps


def subset(cap: Capture, keep: set[str]) -> Capture:
    """The capture with only the tables in ``keep`` (the others present but empty)."""
    ranks = []
    for rt in cap.ranks:
        meta = copy.deepcopy(rt.meta)
        meta["rows"] = {t: n for t, n in meta.get("rows", {}).items() if t in keep}
        ranks.append(RankTrace(rank=rt.rank, source=rt.source, meta=meta, store_dir=None,
                               _tables={t: rt.table(t) if t in keep else empty_table(t) for t in TABLES}))
    return Capture(ranks=ranks)


@pytest.mark.parametrize("name", ["gpt2", "ddp4_hw"])
@pytest.mark.parametrize("table", TABLES)
def test_each_table_alone_and_each_missing(real, name, table):
    cap = real[name]
    alone = every_entry_point(subset(cap, {table}))
    assert len(alone["ranks"]) == len(cap.ranks)
    missing = every_entry_point(subset(cap, set(TABLES) - {table}))
    if table not in ("kernels", "memops", "runtime", "annotations") and len(cap.ranks[0].table(table)):
        # the step breakdown does not depend on this table: same steps as the whole capture
        whole = [s["step"] for s in build_report(cap)["ranks"][0]["steps"]]
        assert [s["step"] for s in missing["ranks"][0]["steps"]] == whole


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from(["gpt2", "ddp4_hw"]), keep=st.sets(st.sampled_from(TABLES)))
def test_random_subsets_of_tables(real, name, keep):
    every_entry_point(subset(real[name], keep))


def test_gpu_only_export_without_runtime_events(tmp_path):
    """The input of issue 18 item 3: kernels and no CUDA runtime events (KeyError 'ts' before)."""
    with gzip.open(DATA / "gpt2_train_stall.json.gz") as f:
        doc = json.load(f)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    p = tmp_path / "gpu_only.json"
    p.write_text(json.dumps(doc))
    cap = open_capture(str(p))
    rt = cap.ranks[0]
    assert len(rt.kernels) == 5765 and len(rt.runtime) == 0
    rep = every_entry_point(cap)
    r = rep["ranks"][0]
    assert r["top_kernels"] and r["summary"]["gpu_busy_pct"] > 0
