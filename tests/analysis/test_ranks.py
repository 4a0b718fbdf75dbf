"""Cross-rank analysis: alignment, arrivals, robust outliers, stragglers (analysis/ranks.py)."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.analysis import ranks as rk
from aiprof.pipeline import build_report
from aiprof.trace.store import RankTrace, open_capture
from aiprof.trace.table import Strings, Table


@pytest.fixture(scope="module")
def ddp_report(ddp2_dir):
    return build_report(open_capture(str(ddp2_dir)))


def _straggler(rep: dict) -> list[dict]:
    """The straggler causes: built from the difference (STRAGGLER) or a detector's, promoted."""
    return [c for c in rep["causes"] if "straggler" in c["evidence"]]


def test_ddp2_rank1_is_the_straggler_with_its_extra_compute(ddp_report):
    strag = _straggler(ddp_report)
    assert [c["rank"] for c in strag] == [1] and strag[0]["code"] == "STRAGGLER"
    st = strag[0]["evidence"]["straggler"]
    assert st["last_arrivals"] == st["collectives"] == 52  # rank 1 arrives last at every all-reduce
    assert st["waiting_ranks"] == [0]
    assert st["by_class"][0]["cls"] == "gpu: compute"  # what makes it slow: GPU compute...
    assert 7_000 < st["by_class"][0]["delta_per_step_us"] < 13_000  # ...about 10 ms/step of it
    top = strag[0]["evidence"]["differs"]["kernels"][0]  # ...the 60 extra 4096² matmuls per step
    assert top["delta_calls"] == 60 and top["cls"] == "compute"
    assert "rank 1" in strag[0]["title"] and "+60 calls" in strag[0]["title"]
    assert strag[0]["saving"]["method"] == "joint replay"
    # rank 0's waits and exposed communication are its symptoms
    waits = [s for s in ddp_report["symptoms"] if s["code"] == "WAITING_RANK"]
    assert [s["rank"] for s in waits] == [0] and waits[0]["explained_by"][0]["cause"] == strag[0]["id"]
    comm = {s["rank"]: s for s in ddp_report["symptoms"] if s["code"] == "EXPOSED_COMM"}
    assert comm[0]["explained_by"][0]["cause"] == strag[0]["id"]
    assert comm[0]["us"] > 3 * comm.get(1, {"us": 0.0})["us"]


def test_ddp2_alignment_and_matrix(ddp_report):
    cr = ddp_report["cross_rank"]
    al = cr["alignment"]
    assert al["matched"] == {"0": 52, "1": 52}
    # one host, one clock: the estimated offset is tiny and its spread small
    assert abs(al["offset_us"]["1"]) < 500 and al["spread_us"]["1"] < 100
    assert cr["flags"] == {"0": ["waiting"], "1": ["abnormal", "straggler"]}
    m = cr["matrix"]
    assert m["ranks"] == [0, 1] and m["steps"] == [1, 2, 3, 4]
    r1 = ddp_report["ranks"][1]["steps"]
    assert m["compute_us"][1] == [round(s["compute_us"], 3) for s in r1]
    assert all(a > b for a, b in zip(m["exposed_comm_us"][0], m["exposed_comm_us"][1]))


def test_missing_ranks_are_named(ddp2_dir):
    cap = open_capture(str(ddp2_dir))
    for rt in cap.ranks:
        rt.meta = dict(rt.meta, world_size=4)  # as if ranks 2 and 3 had written no trace
    rep = build_report(cap)
    assert rep["cross_rank"]["missing_ranks"] == [2, 3]
    strag = _straggler(rep)
    assert [c["rank"] for c in strag] == [1] and strag[0]["evidence"]["straggler"]["missing_ranks"] == [2, 3]


# ------------------------------------------------------------------ synthetic collectives
def _rc(rank, start, dur, sig="AllReduce:100", pg="0", step=None):
    start = np.asarray(start, dtype=np.int64)
    n = len(start)
    return rk.RankCollectives(rank, "gpu", np.array([pg] * n, dtype=object), np.array([sig] * n, dtype=object),
                              start, start + np.asarray(dur, dtype=np.int64), np.full(n, -1, np.int64),
                              np.full(n, -1, np.int64) if step is None else np.asarray(step, np.int64))


def test_alignment_recovers_clock_offset_and_shifted_lists():
    rng = np.random.default_rng(0)
    period = 10_000_000  # 10 ms between all-reduces
    t = np.arange(40) * period + rng.integers(0, 2_000_000, 40)  # irregular compute before each
    late = 3_000_000  # rank 2 arrives 3 ms late at every collective
    dur0 = 1_000_000
    ends = t + late + dur0  # all end together, 1 ms after the last arrival
    r0 = _rc(0, t, ends - t)
    r1 = _rc(1, t[:] + 500_000 + 7_000_000_000, ends - t - 500_000)  # clock 7 s ahead, 0.5 ms late
    # rank 2: clock 2 ms behind, its trace starts 3 collectives later
    s2 = (t + late)[3:] - 2_000_000
    r2 = _rc(2, s2, np.full(len(s2), dur0))
    al, arr = rk.align_and_arrivals([r0, r1, r2])
    assert al.reference_rank == 0
    assert al.offset_us[1] == pytest.approx(-7_000_000.0, abs=1)
    assert al.offset_us[2] == pytest.approx(2_000.0, abs=1)
    assert al.matched == {0: 40, 1: 40, 2: 37}
    assert arr.collectives == 40
    assert arr.last_count[2] == 37  # last wherever it took part
    assert arr.caused_wait_us[2] == pytest.approx(37 * 2_500.0, rel=1e-6)  # last - second last
    # rank 0 waits 3 ms for rank 2, and 0.5 ms for rank 1 where rank 2 had not started tracing
    assert arr.waited_us[0] == pytest.approx(37 * 3_000.0 + 3 * 500.0, rel=1e-6)


def test_alignment_uses_step_numbers_over_a_periodic_pattern():
    # identical periodic steps and clocks 1.5 periods apart: step numbers fix the pairing
    t = np.arange(12) * 1_000_000
    steps = np.repeat(np.arange(4), 3)
    r0 = _rc(0, t, np.full(12, 100_000), step=steps)
    r1 = _rc(1, t[3:] + 1_500_000, np.full(9, 100_000), step=steps[3:])  # starts at step 1
    al, _ = rk.align_and_arrivals([r0, r1])
    assert al.matched[1] == 9
    assert al.offset_us[1] == pytest.approx(-1_500.0)


def _kernel_trace(rank: int, names: list[str], ts: list[int], dur: int) -> RankTrace:
    labels = sorted(set(names))
    k = Table({"ts": np.array(ts, np.int64), "dur": np.full(len(ts), dur, np.int64),
               "stream": np.full(len(ts), 7, np.int64),
               "name": Strings(np.array([labels.index(n) for n in names], np.int32), labels),
               "cls": Strings(np.zeros(len(ts), np.int32), ["communication"])})
    return RankTrace(rank=rank, source=f"r{rank}", meta={"world_size": 3}, _tables={"kernels": k})


@pytest.mark.parametrize("name", ["ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
                                  "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"])
def test_both_nccl_naming_schemes_without_collective_args(name):
    # traces whose NCCL kernels carry no collective args: matched by kernel name and order
    t = [i * 5_000_000 for i in range(6)]
    a = _kernel_trace(0, [name] * 6, t, 3_000_000)
    b = _kernel_trace(1, [name] * 6, [x + 2_000_000 for x in t], 1_000_000)  # 2 ms late
    c = [rk.rank_collectives(x) for x in (a, b)]
    assert [x.side for x in c] == ["kernels", "kernels"] and c[0].sig[0] == "AllReduce"
    al, arr = rk.align_and_arrivals(c)
    assert al.offset_us[1] == 0.0 and arr.last_count == {0: 0, 1: 6}
    assert arr.caused_wait_us[1] == pytest.approx(6 * 2_000.0)


# ------------------------------------------------------------------ robust outlier rule
def test_robust_rule_two_ranks():
    mask, _, med = rk.abnormal_mask(np.array([[60_000.0], [72_000.0]]))
    assert mask[:, 0].tolist() == [False, True] and med[1, 0] == 60_000.0
    mask, _, _ = rk.abnormal_mask(np.array([[60_000.0], [63_000.0]]))  # 5 %: noise
    assert not mask.any()


def test_robust_rule_thousand_ranks():
    rng = np.random.default_rng(1)
    x = rng.normal(60_000.0, 1_200.0, size=(1000, 2))  # 2 % noise
    assert not rk.abnormal_mask(x)[0].any()
    x[737, 0] = 75_000.0
    x[12, 1] = 90_000.0
    mask, z, _ = rk.abnormal_mask(x)
    assert [tuple(p) for p in np.argwhere(mask)] == [(12, 1), (737, 0)]
    # the leave-one-out median agrees with a direct computation
    direct = np.median(np.delete(x[:, 0], 737))
    assert rk.loo_median(x)[737, 0] == pytest.approx(direct)


def test_loo_median_small():
    x = np.array([[1.0], [5.0], [2.0], [9.0]])
    want = [np.median(np.delete(x[:, 0], i)) for i in range(4)]
    assert rk.loo_median(x)[:, 0].tolist() == want


def test_ddp4_h200_rank2_is_the_straggler(ddp4_dir):
    rep = build_report(open_capture(str(ddp4_dir)))
    strag = _straggler(rep)
    assert [c["rank"] for c in strag] == [2]
    ev = strag[0]["evidence"]["straggler"]
    assert ev["last_arrivals"] == ev["collectives"] > 0
    assert sorted(ev["waiting_ranks"]) == [0, 1, 3]
    assert ev["by_class"][0]["cls"] == "gpu: compute"
    assert strag[0]["evidence"]["differs"]["kernels"][0]["delta_calls"] == 40  # the 40 extra matmuls per step
    # balancing the ranks is the first thing to fix in this job
    assert rep["causes"][0]["id"] == strag[0]["id"] and strag[0]["severity"] == "high"
    cr = rep["cross_rank"]
    assert cr["world_size"] == 4 and cr["missing_ranks"] == []
    assert cr["flags"]["2"] == ["abnormal", "straggler"]
    assert all(cr["flags"][str(r)] == ["waiting"] for r in (0, 1, 3))
    waits = sorted(s["rank"] for s in rep["symptoms"] if s["code"] == "WAITING_RANK")
    assert waits == [0, 1, 3]  # the waiting ranks, never the straggler


def test_ddp4_three_of_four_traces(ddp4_dir, tmp_path):
    # rank 3's trace lost: still rank 2, and rank 3 named as missing
    import shutil
    for r in (0, 1, 2):
        shutil.copy(ddp4_dir / f"ddp4_slow2_rank{r}.json.gz", tmp_path)
    rep = build_report(open_capture(str(tmp_path)))
    assert rep["cross_rank"]["missing_ranks"] == [3]
    assert [c["rank"] for c in _straggler(rep)] == [2]


def _match_lists_one_shift_at_a_time(sig_a, step_a, end_a, seq_a, sig_b, step_b, end_b, seq_b) -> np.ndarray:
    """match_lists' shift search as it was written before its shifts were compared at once (the
    reference; the lists below carry no sequence numbers, which would decide instead)."""
    na, nb = len(sig_a), len(sig_b)
    out = np.full(na, -1, dtype=np.int64)
    if not na or not nb:
        return out
    k = min(rk.ALIGN_MAX_SHIFT, max(na, nb) - 1)
    need = max(1, int(np.ceil(rk.ALIGN_MIN_OVERLAP * min(na, nb))))
    numbered = (step_a >= 0).any() and (step_b >= 0).any()
    agreeing = []
    for s in range(-k, k + 1):
        i0, i1 = max(0, -s), min(na, nb - s)
        if i1 - i0 < need:
            continue
        agree = sig_a[i0:i1] == sig_b[i0 + s:i1 + s]
        if numbered:
            agree &= step_a[i0:i1] == step_b[i0 + s:i1 + s]
        agreeing.append((np.count_nonzero(agree) / (i1 - i0), s))
    if not agreeing:
        return out
    best = max(c[0] for c in agreeing)
    cands = []
    for frac, s in agreeing:
        if frac >= best - rk.ALIGN_AGREE_TOL:
            i0, i1 = max(0, -s), min(na, nb - s)
            r = (end_a[i0:i1] - end_b[i0 + s:i1 + s]).astype(np.float64)
            cands.append((frac, float(np.median(np.abs(r - np.median(r)))), abs(float(np.median(r))), s))
    low = min(c[1] for c in cands)
    _, _, _, s = min((c for c in cands if c[1] <= low + rk.ALIGN_MAD_TOL_NS), key=lambda c: (c[2], abs(c[3])))
    i0, i1 = max(0, -s), min(na, nb - s)
    out[i0:i1] = np.arange(i0, i1) + s
    return out


def test_match_lists_pairs_as_one_shift_at_a_time(ddp, ddp4_dir, monkeypatch):
    """The shifts compared at once (in blocks) pair the same collectives as one shift per numpy
    call did: on the real ranks' lists of two jobs, with collectives dropped, added or renamed at
    either end or inside, steps unnumbered, and with blocks of a few shifts."""
    rng = np.random.default_rng(7)
    lists = [rk.rank_collectives(rt) for cap in (ddp, open_capture(str(ddp4_dir))) for rt in cap.ranks]
    assert all(len(c) >= 9 and not (c.seq >= 0).any() for c in lists)  # the shift search decides

    def cut(c, keep: np.ndarray) -> tuple:
        return c.sig[keep], c.step[keep], c.end[keep], np.full(int(keep.sum()), -1, np.int64)

    cases = []
    for a in lists:
        for b in lists:
            n_a, n_b = len(a), len(b)
            cases.append((cut(a, np.ones(n_a, bool)), cut(b, np.ones(n_b, bool))))
            for _ in range(4):  # dropped collectives, anywhere
                ka, kb = rng.random(n_a) > rng.uniform(0, 0.3), rng.random(n_b) > rng.uniform(0, 0.3)
                cases.append((cut(a, ka), cut(b, kb)))
            lo, hi = rng.integers(0, max(2, min(n_a, n_b) // 4), 2)  # the first or last few missing
            sa = cut(a, (np.arange(n_a) >= lo))
            sb = cut(b, (np.arange(n_b) < n_b - hi))
            cases.append((sa, sb))
            renamed = sb[0].copy()  # a renamed one (another size), steps unnumbered
            renamed[rng.integers(0, len(renamed))] = "AllReduce:1"  # (a quarter at most cut: not empty)
            cases.append((sa, (renamed, np.full(len(renamed), -1), sb[2], sb[3])))
    for small_blocks in (False, True):
        if small_blocks:
            monkeypatch.setattr(rk, "MATCH_BLOCK_CELLS", 200)  # a few shifts per block
        for (sa, sb) in cases:
            got = rk.match_lists(*sa, *sb)
            want = _match_lists_one_shift_at_a_time(*sa, *sb)
            assert np.array_equal(got, want)
    assert len(cases) > 100


def test_median_is_numpys():
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 51, 52):
        for x in (rng.normal(size=n) * 1e9, np.round(rng.normal(size=n) * 1e3), np.full(n, 2.5)):
            assert rk._median(x) == float(np.median(x))
    assert np.isnan(rk._median(np.array([1.0, np.nan, 3.0])))
