"""Per-rank results kept beside the stores (scale.results): a second analysis of an unchanged
capture reads them and gives the same report, byte for byte; any changed input is recomputed;
a damaged or foreign file is a miss, never an error or a wrong result."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from aiprof.report import json_report
from aiprof.scale import engines, results, tasks
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files
from tests.conftest import DATA


@pytest.fixture
def ddp4(tmp_path) -> list[str]:
    """Its own copy of ddp4 (rank 2 the straggler): other tests' results are not read here."""
    for r in range(4):
        shutil.copy(DATA / f"ddp4_slow2_rank{r}.json.gz", tmp_path)
    return find_trace_files([str(tmp_path)])


def _run(files: list[str], reuse: bool = True) -> tuple[bytes, dict]:
    with engines.SerialEngine() as eng:
        rep = build_job_report(files, eng, reuse=reuse, keep=True)
    return json_report.encode(rep), {p: (v["tasks"], v.get("reused", 0)) for p, v in eng.stats.by_phase.items()}


def test_a_second_run_reads_every_result_and_gives_the_same_report(ddp4):
    first, ran = _run(ddp4)
    assert ran == {"ingest": (4, 0), "analyse": (4, 0), "stragglers": (1, 0)}
    for f in ddp4:
        assert {p.name for p in Path(results.path_for(f, "ingest")).parent.iterdir()} >= {"ingest.msgpack",
                                                                                        "analyse.msgpack"}
    second, again = _run(ddp4)
    assert again == {"ingest": (0, 4), "analyse": (0, 4), "stragglers": (0, 1)}
    assert second == first
    fresh, none = _run(ddp4, reuse=False)  # computed again, not read (--no-cache): the same report
    assert none == ran and fresh == first
    assert _run(ddp4)[1] == again  # and kept again


def test_a_changed_trace_is_recomputed_with_what_read_it(ddp4):
    first, _ = _run(ddp4)
    st = os.stat(ddp4[1])
    os.utime(ddp4[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # as if rewritten
    again, ran = _run(ddp4)
    assert ran["ingest"] == (1, 3)  # only rank 1 is ingested again
    # rank 1's own analysis at least; the others' only where rank 1 is their partner
    assert ran["analyse"][0] >= 1 and sum(ran["analyse"]) == 4
    assert again == first


def test_other_code_is_a_miss(ddp4, monkeypatch):
    _run(ddp4)
    monkeypatch.setattr(results, "code_version", lambda: "another aiprof")
    _, ran = _run(ddp4)
    assert ran == {"ingest": (4, 0), "analyse": (4, 0), "stragglers": (1, 0)}


@pytest.mark.parametrize("damage", [b"", b"\x93garbage", b"\x92\xa3key\xc4\x03abc"])
def test_a_damaged_or_foreign_file_is_a_miss(ddp4, damage):
    first, _ = _run(ddp4)
    for f in ddp4:
        Path(results.path_for(f, "analyse")).write_bytes(damage)
    again, ran = _run(ddp4)
    assert ran["analyse"] == (4, 0) and ran["ingest"] == (0, 4)
    assert again == first


def test_a_result_under_another_key_is_not_read(ddp4):
    _run(ddp4)
    path = results.path_for(ddp4[0], "ingest")
    assert results.load(path, "0" * 64, results.result_type(tasks.ingest_rank)) is None


def test_a_store_where_nothing_can_be_kept_still_analyses(ddp4):
    """A results folder that cannot be made (here a file in its place, which stops root too):
    nothing is kept or read, and the analysis is the same."""
    first, _ = _run(ddp4)
    for f in ddp4:
        where = Path(results.path_for(f, "ingest")).parent
        shutil.rmtree(where)
        where.write_text("not a folder")
    for _ in range(2):
        again, ran = _run(ddp4)
        assert ran == {"ingest": (4, 0), "analyse": (4, 0), "stragglers": (1, 0)}
        assert again == first


def test_numpy_values_come_back_with_their_types(tmp_path):
    """What the tasks' results hold: arrays of numbers and of strings, numpy scalars inside
    untyped dicts, tuples in typed fields; the result type's annotations drive the decoding."""
    rc = tasks.Collectives(rank=3, side="gpu", pg=np.array(["0", "1"], dtype=object),
                           sig=np.array(["allreduce:4", "allreduce:8"], dtype=object),
                           start=np.array([1, 2], dtype=np.int64), end=np.array([3.5, 4.5]),
                           seq=np.array([-1, 7], dtype=np.int32), step=np.zeros((0,), dtype=np.int64))
    want = tasks.Ingested(rank=3, index=1, source="s", host="h", world_size=4, collectives=rc,
                          comm_end=np.arange(6, dtype=np.float32).reshape(2, 3), unprofiled_ns=None)
    path = str(tmp_path / "r" / "ingest.msgpack")
    results.save(path, "k", want)
    got = results.load(path, "k", results.result_type(tasks.ingest_rank))
    assert isinstance(got, tasks.Ingested) and isinstance(got.collectives, tasks.Collectives)
    for name in ("pg", "sig", "start", "end", "seq", "step"):
        a, b = getattr(got.collectives, name), getattr(rc, name)
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), name
    assert got.comm_end.dtype == np.float32 and got.comm_end.shape == (2, 3) and got.comm_end.flags.writeable
    path2 = str(tmp_path / "a.msgpack")
    ev = {"share": np.float32(0.25), "n": np.int64(3), "ok": np.bool_(True), "ids": [1, 2], "none": None}
    results.save(path2, "k", ev)
    back = results.load(path2, "k", dict)
    assert back == ev and [type(v) for v in back.values()] == [type(v) for v in ev.values()]


def test_a_trace_gone_before_its_key_is_the_usual_one_line_error(ddp4, tmp_path):
    from aiprof.errors import TraceError

    gone = tmp_path / "rank9.json.gz"
    with engines.SerialEngine() as eng, pytest.raises(TraceError, match="no such file"):
        build_job_report([*ddp4, str(gone)], eng, reuse=True, keep=True)
