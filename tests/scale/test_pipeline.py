"""The per-rank pipeline (aiprof.scale) run in this process: it gives the in-process report on
small jobs, couples ranks like the in-process diagnosis, picks its engine by rank count."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from aiprof.pipeline import build_report
from aiprof.diagnosis import job
from aiprof.diagnosis.graph import RankCollectives
from aiprof.errors import AiprofError, TraceError, UsageError
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report, partners
from aiprof.trace.store import find_trace_files, open_capture
from tests.deps import need


def _coupling_reference(columns: dict, ends: dict) -> dict:
    """attach_collectives' coupling as it was written before job.coupling (one copy of the
    rank x collective matrix per rank): the definition job.coupling must keep."""
    idx, colls, off = columns["rank_index"], columns["collectives"], columns["offset_ns"]
    ranks = [r for r in ends if r in idx and r in colls]
    n_col = len(next(iter(idx.values())))
    start = np.full((len(ranks), n_col), np.nan)
    end = np.full((len(ranks), n_col), np.nan)
    for i, r in enumerate(ranks):
        ix = idx[r]
        ok = ix >= 0
        start[i, ok] = colls[r].start[ix[ok]] + off.get(r, 0.0)
        end[i, ok] = ends[r][ix[ok]] + off.get(r, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        transfer = np.nanmin(end - start, axis=0)
    out = {}
    for i, r in enumerate(ranks):
        ix = idx[r]
        ok = np.nonzero(ix >= 0)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN, as intended
            latest = np.nanmax(np.delete(start, i, axis=0), axis=0)
        have = ok[~np.isnan(latest[ok]) & ~np.isnan(transfer[ok])]
        out[r] = RankCollectives(ids=have.astype(np.int64), start=colls[r].start[ix[have]], end=ends[r][ix[have]],
                                 host=False, others={int(c): float(latest[c] - off.get(r, 0.0)) for c in have},
                                 transfer={int(c): float(max(transfer[c], 0.0)) for c in have})
    return out


class _Coll:
    def __init__(self, start):
        self.start = start
        self.side = "gpu"


@pytest.mark.parametrize("n_ranks", [2, 3, 9])
def test_coupling_matches_the_per_rank_definition(n_ranks):
    """Top-two per column gives every rank the others' latest arrival, ties and absences included."""
    rng = np.random.default_rng(n_ranks)
    n_col = 40
    idx, colls, ends, off = {}, {}, {}, {}
    for r in range(n_ranks):
        n = n_col + 3
        st = np.sort(rng.integers(0, 10_000, n)).astype(np.int64)
        st[5] = st[4]  # equal arrivals on one rank
        colls[r] = _Coll(st)
        ends[r] = st + rng.integers(1, 500, n)
        ix = rng.permutation(n)[:n_col]
        ix[rng.random(n_col) < 0.15] = -1  # absent from some collectives
        idx[r] = ix
        off[r] = float(rng.integers(-50, 50))
    if n_ranks > 2:
        idx[0][7] = idx[1][7] = -1  # a column only some ranks have
    columns = {"rank_index": idx, "collectives": colls, "offset_ns": off}
    got, want = job.coupling(columns, ends), _coupling_reference(columns, ends)
    assert set(got) == set(want) == set(range(n_ranks))
    for r in want:
        assert np.array_equal(got[r].ids, want[r].ids)
        assert got[r].others == want[r].others
        assert got[r].transfer == want[r].transfer


def test_small_jobs_give_the_in_process_report(ddp2_dir):
    """With two ranks each rank's partner is the other: the pair replay is the joint replay, so
    the per-rank pipeline's report is the in-process one, field for field."""
    files = find_trace_files([str(ddp2_dir)])
    want = build_report(open_capture(files))
    with engines.SerialEngine() as eng:
        got = build_job_report(files, eng)
    assert got == want
    assert got["cross_rank"]["stragglers"][0]["straggler_rank"] == 1


def test_four_ranks_straggler_and_causes(ddp4_dir):
    """ddp4: the same ranks, cross-rank comparison and symptoms as in-process; the straggler
    named and priced like the joint replay; every in-process cause found."""
    files = find_trace_files([str(ddp4_dir)])
    want = build_report(open_capture(files))
    seen = []
    with engines.SerialEngine() as eng:
        got = build_job_report(files, eng, progress=lambda *a: seen.append(a))
        assert eng.stats.tasks == 4 + 4 + 1 and eng.stats.worker_cpu_s > 0
    assert got["ranks"] == want["ranks"]
    assert got["cross_rank"] == want["cross_rank"]
    assert [(s["code"], s["rank"], s["us"]) for s in got["symptoms"]] == \
        [(s["code"], s["rank"], s["us"]) for s in want["symptoms"]]
    top, ref = got["causes"][0], want["causes"][0]
    assert (top["code"], top["rank"]) == (ref["code"], ref["rank"]) == ("STRAGGLER", 2)
    assert top["saving"]["share"] == pytest.approx(ref["saving"]["share"], rel=0.1)
    assert {(c["code"], c["rank"]) for c in want["causes"]} <= {(c["code"], c["rank"]) for c in got["causes"]}
    assert seen[-1] == ("stragglers", 1, 1) and ("ingest", 4, 4) in seen and ("analyse", 4, 4) in seen


def test_partner_holds_the_job_back():
    waited = {0: 9.0, 1: 8.7, 2: 0.0, 3: 9.1}
    caused = {0: 0.1, 1: 0.0, 2: 9.0, 3: 0.2}
    got = partners([0, 1, 2, 3], waited, {0: 1, 1: 1, 2: 1, 3: 1}, caused)
    # rank 2 made the others wait: every rank is priced with it (a waiting rank's fix cannot
    # beat it); rank 2 itself with the most typical rank: the median wait is 8.85, ranks 0 (9.0)
    # and 1 (8.7) tie, the lower rank first
    assert got == {0: 2, 1: 2, 2: 0, 3: 2}
    # nobody made anybody wait: the most typical rank, and for it the next most typical
    assert partners([0, 1, 2, 3], waited, {0: 1, 1: 1, 2: 1, 3: 1}, {}) == {0: 1, 1: 0, 2: 0, 3: 0}
    assert partners([0, 1], {}, {0: 1}) == {}


def test_duplicate_rank_is_one_line(tmp_path, ddp2_dir):
    src = ddp2_dir / "ddp2_slow1_rank0.json.gz"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "rank0.json.gz").write_bytes(src.read_bytes())
    with engines.SerialEngine() as eng, pytest.raises(TraceError, match="rank 0 appears twice"):
        build_job_report(find_trace_files([str(tmp_path)]), eng)


@pytest.mark.parametrize(("engine", "n", "cluster", "want"), [
    ("auto", 1, None, "local"), ("auto", engines.RAY_MIN_RANKS - 1, None, "local"),
    ("auto", engines.RAY_MIN_RANKS, None, "ray"), ("auto", 2, "ray://head:10001", "ray"),
    ("local", 5000, None, "local"), ("ray", 1, None, "ray")])
def test_engine_choice(engine, n, cluster, want):
    assert engines.choose(engine, n, cluster) == want


def test_engine_choice_refuses_nonsense():
    with pytest.raises(UsageError):
        engines.choose("local", 2, "ray://head:10001")
    with pytest.raises(UsageError):
        engines.choose("dask", 2)


def test_unreachable_cluster_is_one_line_at_once():
    need("ray")
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(AiprofError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        engines.RayEngine(f"127.0.0.1:{port}")


def test_driver_steps_leave_garbage_collection_as_they_found_it():
    """The driver's steps pause automatic collection (job_report._gc_paused) and give it back as
    it was: on, off (a caller that had turned it off), and after an error inside."""
    import gc

    from aiprof.scale.job_report import _gc_paused

    was = gc.isenabled()
    try:
        gc.enable()
        with _gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(ValueError), _gc_paused():
            raise ValueError("a step failed")
        assert gc.isenabled()
        gc.disable()
        with _gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
