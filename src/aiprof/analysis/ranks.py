"""Cross-rank analysis: clock alignment, per-rank class times, abnormal workers, stragglers and
the rank × step matrix. Definitions in docs/metrics.md ("Cross-rank"), rules in
docs/findings.md (STRAGGLER_RANK, ABNORMAL_WORKER).

The ranks of one capture are compared with each other:

* **Clock alignment.** The same collective ends at nearly the same instant on every rank that
  takes part (a ring/tree all-reduce cannot finish on one rank before the data of the others has
  arrived), so the difference of the end times of matched collectives is the offset between two
  ranks' clocks. Collectives are matched per process group, by sequence number when the trace
  has it, else by their order (the shift between two ranks' lists is searched: the one whose
  collectives agree in type, size and step number and whose end-time differences are smallest
  and most constant).
* **Arrivals.** On the aligned clock, a collective's start on each rank is when that rank
  arrived; the last to arrive makes all others wait. The wait it alone caused is the gap between
  the last and the second-last arrival.
* **Abnormal workers**: a robust outlier rule (leave-one-out median, MAD with a noise floor) over
  per-rank work metrics; stable with 2 ranks and with thousands.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis import rankdiff
from aiprof.analysis.diff import diff_captures
from aiprof.analysis.intervals import union
from aiprof.analysis.launch import launch_ts
from aiprof.analysis.steps import find_steps
from aiprof.records import as_dict
from aiprof.trace import classify
from aiprof.trace.store import Capture, RankTrace

NS_PER_US = 1000.0
# --- clock alignment
ALIGN_MAX_SHIFT = 64  # largest shift (in collectives) searched between two ranks' lists
ALIGN_MIN_OVERLAP = 0.5  # a shift must pair at least this share of the shorter list
ALIGN_AGREE_TOL = 0.05  # shifts within this share of the best type/size/step agreement compete on time
ALIGN_MAD_TOL_NS = 50_000  # shifts whose end-time spread is within 50 µs of the best tie on |offset|
MATCH_BLOCK_CELLS = 1 << 20  # (collective, shift) pairs compared at once: a few arrays of 8 bytes a pair
# --- stragglers: a rank whose late arrivals alone make the others wait
STRAGGLER_MIN_WAIT_US = 200.0  # caused wait per step, at least this...
STRAGGLER_MIN_WAIT_SHARE = 0.02  # ...and this share of the median step time
STRAGGLER_MIN_CAUSED_SHARE = 0.25  # and this share of all the wait caused by last arrivals
STRAGGLER_HIGH_SHARE = 0.10  # high severity from this share of the step time
# --- abnormal workers (robust z over ranks)
ABNORMAL_Z = 3.5  # Iglewicz & Hoaglin's cut-off for the modified z-score
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution * this = its standard deviation
ABNORMAL_NOISE_FLOOR = 0.03  # sigma is at least 3 % of the median (run-to-run noise), so 2 ranks work
ABNORMAL_MIN_REL = 0.10  # and the rank is at least 10 % above the median of the others
ABNORMAL_MIN_US = 200.0  # and at least 200 µs per step above it
ABNORMAL_HIGH_REL = 0.50  # high severity from 50 % above
ABNORMAL_EXACT_LOO_MAX = 64  # up to this many ranks the MAD is computed leaving the rank out
# Metrics compared for abnormal workers: work a rank does itself. Communication, GPU idle while
# the host dispatches/launches/syncs are left out: a rank that waits for a straggler shows them
# (STRAGGLER_RANK covers that); GPU idle while loading input is the rank's own.
WORK_CLASSES = ("gpu: compute", "gpu: memory ops", "host: data loading")
# Host-side collective backends whose annotations mark each collective (name prefix).
_HOST_BACKEND_PREFIXES = ("gloo:",)
# Classes that can explain what makes a straggler slow (all but communication and the unexplained)
_CAUSE_EXCLUDE = ("gpu: communication", "host: no traced event")


# ------------------------------------------------------------------------------- collectives
@dataclass
class RankCollectives:
    """One rank's collectives, in issue order per process group (times in ns, rank's own clock)."""

    rank: int
    side: str  # "gpu" (NCCL kernels), "kernels" (kernel names only), "cpu" (host ops, e.g. gloo)
    pg: np.ndarray  # object: process group name ("" when unknown)
    sig: np.ndarray  # object: "type:nelems"
    start: np.ndarray
    end: np.ndarray
    seq: np.ndarray  # -1 when the trace has no sequence numbers
    step: np.ndarray  # ProfilerStep number of its launch (-1 outside steps / not numbered)

    def __len__(self) -> int:
        return len(self.start)


def rank_collectives(rt: RankTrace) -> RankCollectives:
    """The rank's collectives: GPU side when present, else NCCL kernels by name, else host side."""
    c = rt.collectives
    side = ""
    gpu_rows = None  # GPU-side rows (with their correlation ids): numbered by their launch's step
    if len(c):
        sides = c.strings("side")
        for want in ("gpu", "cpu"):
            m = sides.isin_labels(lambda s, w=want: s == w)
            if m.any():
                if want == "cpu" and len(rt.kernels) and rt.kernels.strings("cls").isin_labels(
                        lambda s: s == classify.COMMUNICATION).any():
                    break  # GPU kernels without collective args: use the kernels below
                t = c.take(m)
                pg, coll = t["pg_name"], t["coll"]
                sig = np.array([f"{a}:{n}" for a, n in zip(coll, t["in_nelems"])], dtype=object)
                side = want
                start, end, seq = t["ts"], t["ts"] + t["dur"], t["seq"]
                gpu_rows = t if want == "gpu" else None
                break
    if not side:
        side, pg, sig, start, end, seq = _host_backend_collectives(rt)
    if not side:
        k = rt.kernels
        if len(k):
            m = k.strings("cls").isin_labels(lambda s: s == classify.COMMUNICATION)
        if len(k) and m.any():
            t = k.take(m)
            names = t.strings("name")
            ctype = np.array([classify.collective_type(s) for s in names.labels] + [""], dtype=object)
            sig = ctype[names.codes]
            pg = np.array([f"stream {s}" for s in t["stream"]], dtype=object)
            side, start, end = "kernels", t["ts"], t["ts"] + t["dur"]
            seq = np.full(len(t), -1, dtype=np.int64)
            gpu_rows = t
        else:
            z = np.zeros(0, dtype=np.int64)
            return RankCollectives(rt.rank, "", np.zeros(0, object), np.zeros(0, object), z, z, z, z)
    order = np.argsort(start, kind="stable")
    steps = find_steps(rt)
    st = start[order]
    if steps.source == "ProfilerStep":
        # a GPU-side collective is numbered by the step that launched it: the GPU runs behind the
        # host, by more on some ranks than on others (a rank whose GPU waits for its collectives),
        # so the step its kernel runs in would differ across ranks for the same collective
        i = steps.index_of(launch_ts(rt.runtime, gpu_rows)[order] if gpu_rows is not None else st)
        num = npx.take(steps.number, i, -1)
    else:
        num = np.full(len(st), -1, dtype=np.int64)
    return RankCollectives(rt.rank, side, np.asarray(pg, dtype=object)[order], np.asarray(sig, dtype=object)[order],
                           st.astype(np.int64), np.asarray(end)[order].astype(np.int64),
                           np.asarray(seq)[order].astype(np.int64), num.astype(np.int64))


def _host_backend_collectives(rt: RankTrace):
    """Collectives a host backend ran, from its annotations (``gloo:all_reduce`` with the tensor's
    dims), when the trace has no collective arguments (gloo in torch 2.11 records none):
    (side, pg, sig, start, end, seq), side "" when there are none."""
    a = rt.annotations
    if not len(a):
        return "", None, None, None, None, None
    m = a.strings("name").isin_labels(lambda s: s.startswith(_HOST_BACKEND_PREFIXES)) & ~a["gpu"]
    if not m.any():
        return "", None, None, None, None, None
    t = a.take(m)
    names = t["name"]
    sig = np.array([classify.collective_type(n) or n for n in names], dtype=object)
    pg = np.array([n.split(":", 1)[0] for n in names], dtype=object)
    return "cpu", pg, sig, t["ts"], t["ts"] + t["dur"], np.full(len(t), -1, dtype=np.int64)


# ----------------------------------------------------------------------------------- matching
def _median(x: np.ndarray) -> float:
    """``np.median`` of a non-empty 1-D float array, the same float: the middle value, or the two
    middle ones' mean, from one sort. The matching takes three per candidate shift of each of a
    job's 1,023 pairs of ranks: np.median's 6,148 calls took 0.155 s of it (1,024 ddp2 ranks,
    under cProfile)."""
    s = np.sort(x)
    if np.isnan(s[-1]):  # NaN sorts last; np.median says NaN
        return float(np.median(x))
    h = len(s) // 2
    return float(s[h]) if len(s) % 2 else float((s[h - 1] + s[h]) / 2)


def _mad(x: np.ndarray) -> float:
    return _median(np.abs(x - _median(x))) if len(x) else 0.0


def match_lists(sig_a: np.ndarray, step_a: np.ndarray, end_a: np.ndarray, seq_a: np.ndarray,
                sig_b: np.ndarray, step_b: np.ndarray, end_b: np.ndarray, seq_b: np.ndarray) -> np.ndarray:
    """For each collective of list A, the index of the same collective in list B (or -1).

    Both lists belong to one process group, in issue order. With sequence numbers on both
    sides they decide. Otherwise B is A shifted by some s: the shift chosen is the one whose
    pairs agree best in signature (type:size) and step number; among those within
    ALIGN_AGREE_TOL of the best, the one whose end-time differences are most constant (smallest
    MAD: the same collective ends together, a wrong pairing drifts with the irregular gaps), and
    among those within ALIGN_MAD_TOL_NS of it (a perfectly periodic pattern) the smallest |median|
    offset, then the smallest shift.
    """
    na, nb = len(sig_a), len(sig_b)
    out = np.full(na, -1, dtype=np.int64)
    if not na or not nb:
        return out
    if (seq_a >= 0).all() and (seq_b >= 0).all():
        pos = {int(s): j for j, s in enumerate(seq_b)}
        return np.array([pos.get(int(s), -1) for s in seq_a], dtype=np.int64)
    k = min(ALIGN_MAX_SHIFT, max(na, nb) - 1)
    need = max(1, int(np.ceil(ALIGN_MIN_OVERLAP * min(na, nb))))
    numbered = (step_a >= 0).any() and (step_b >= 0).any()
    # every shift's agreement at once (one shift per column), not one shift per numpy call: a
    # 1,024-rank job matches 1,023 pairs of lists in the driver (2 x 51 shifts each for ddp2's 52
    # collectives); signatures as integer codes, the same for both lists
    codes: dict = {}
    ca = np.array([codes.setdefault(x, len(codes)) for x in sig_a.tolist()], dtype=np.int64)
    cb = np.array([codes.setdefault(x, len(codes)) for x in sig_b.tolist()], dtype=np.int64)
    shifts = np.arange(-k, k + 1)
    counts, overlap = np.zeros(len(shifts), np.int64), np.zeros(len(shifts), np.int64)
    per_block = max(1, MATCH_BLOCK_CELLS // na)  # a long list's matrices stay bounded
    for b0 in range(0, len(shifts), per_block):
        block = shifts[b0:b0 + per_block]
        j = np.arange(na)[:, None] + block[None, :]  # the index in B paired with A's i by each shift
        inside = (j >= 0) & (j < nb)
        jc = np.clip(j, 0, nb - 1)
        agree = (ca[:, None] == cb[jc]) & inside
        if numbered:
            agree &= step_a[:, None] == step_b[jc]
        overlap[b0:b0 + per_block] = np.count_nonzero(inside, axis=0)
        counts[b0:b0 + per_block] = np.count_nonzero(agree, axis=0)
    agreeing = [(c / n, s) for c, n, s in zip(counts.tolist(), overlap.tolist(), shifts.tolist()) if n >= need]
    if not agreeing:
        return out
    best = max(c[0] for c in agreeing)
    # the end-time statistics only of the shifts that agree well enough to be chosen: the medians
    # were most of the matching's time (a 1,024-rank job: 160 per rank, 2.8 s in the driver)
    cands = []
    for frac, s in agreeing:
        if frac >= best - ALIGN_AGREE_TOL:
            i0, i1 = max(0, -s), min(na, nb - s)
            r = (end_a[i0:i1] - end_b[i0 + s:i1 + s]).astype(np.float64)
            cands.append((frac, _mad(r), abs(_median(r)), s))
    low = min(c[1] for c in cands)
    _, _, _, s = min((c for c in cands if c[1] <= low + ALIGN_MAD_TOL_NS), key=lambda c: (c[2], abs(c[3])))
    i0, i1 = max(0, -s), min(na, nb - s)
    out[i0:i1] = np.arange(i0, i1) + s
    return out


@dataclass
class Alignment:
    """Clock offsets (add to a rank's timestamps to put them on the reference rank's clock)."""

    reference_rank: int
    method: str
    offset_us: dict = field(default_factory=dict)  # rank -> µs
    spread_us: dict = field(default_factory=dict)  # rank -> MAD of the end-time differences (µs)
    matched: dict = field(default_factory=dict)  # rank -> collectives matched with its reference


@dataclass
class Arrivals:
    """Who arrived last at each matched collective (aligned clock)."""

    collectives: int  # matched by at least two ranks
    last_count: dict  # rank -> times it arrived last
    present: dict  # rank -> matched collectives it took part in
    caused_wait_us: dict  # rank -> union over its last arrivals of [second last, last]
    waited_us: dict  # rank -> union over collectives of [its own arrival, last arrival]
    worst: list  # the largest single waits: {"collective", "pg", "step", "last_rank", "caused_us"}


def _match_groups(have: list[RankCollectives]) -> tuple[dict, dict, list[str]]:
    """Match each process group's collectives across its member ranks.

    Returns ``(pg_ref, pg_match, order)``: per group its reference rank (the member with most of
    its collectives), per group and member rank the index in that rank's list of each of the
    reference's collectives in the group (-1: not matched), and the groups by member count,
    largest first."""
    by_rank = {c.rank: c for c in have}
    pgs: dict[str, list[int]] = {}
    for c in have:
        for p in npx.unique(c.pg):
            pgs.setdefault(str(p), []).append(c.rank)
    pg_ref: dict[str, int] = {}
    pg_match: dict[str, dict[int, np.ndarray]] = {}
    for p, members in pgs.items():
        counts = [(int((by_rank[r].pg == p).sum()), -r) for r in members]
        ref = -max(counts)[1]
        pg_ref[p] = ref
        a = by_rank[ref]
        ma = np.nonzero(a.pg == p)[0]
        pg_match[p] = {ref: ma}
        for r in members:
            if r == ref:
                continue
            b = by_rank[r]
            mb = np.nonzero(b.pg == p)[0]
            j = match_lists(a.sig[ma], a.step[ma], a.end[ma], a.seq[ma], b.sig[mb], b.step[mb], b.end[mb], b.seq[mb])
            pg_match[p][r] = npx.take(mb, j, -1)
    order = sorted(pgs, key=lambda p: -len(pgs[p]))
    return pg_ref, pg_match, order


def _arrival_matrix(ranks: list[int], by_rank: dict, pg_ref: dict, pg_match: dict, order: list[str],
                    offset: dict) -> dict:
    """One column per collective of each group's reference, matched by at least two ranks: per
    rank (row, in ``ranks`` order) the start on the aligned clock (NaN: not matched), plus per
    column its group, step and, per rank, the index of the collective in that rank's list."""
    idx = {r: i for i, r in enumerate(ranks)}
    cols, pos_cols, col_pg, col_step = [], [], [], []
    for p in order:
        ref = pg_ref[p]
        ia = pg_match[p][ref]
        m = np.full((len(ranks), len(ia)), np.nan)
        pm = np.full((len(ranks), len(ia)), -1, dtype=np.int64)
        for r, ib in pg_match[p].items():
            if r not in offset:
                continue
            ok = ib >= 0
            m[idx[r], ok] = by_rank[r].start[ib[ok]] + offset[r]
            pm[idx[r], ok] = ib[ok]
        cols.append(m)
        pos_cols.append(pm)
        col_pg += [p] * len(ia)
        col_step.append(by_rank[ref].step[ia])
    if not cols:
        z = np.zeros((len(ranks), 0))
        return {"start": z, "index": z.astype(np.int64), "pg": [], "step": np.zeros(0, np.int64)}
    a = np.concatenate(cols, axis=1)
    keep = (~np.isnan(a)).sum(axis=0) >= 2
    return {"start": a[:, keep], "index": np.concatenate(pos_cols, axis=1)[:, keep],
            "pg": [p for p, k in zip(col_pg, keep) if k], "step": np.concatenate(col_step)[keep]}


def align_and_arrivals(colls: list[RankCollectives], columns: dict | None = None) -> tuple[Alignment, Arrivals]:
    """Match collectives across ranks, estimate clock offsets, and score arrivals.

    ``columns``, when given, receives the matching itself: ``{"rank_index": {rank: indices into
    that rank's RankCollectives, one per matched collective (-1: absent)}, "offset_ns": {rank:
    ns to add to the rank's clock}}`` (the what-if replay couples ranks through it)."""
    ranks = [c.rank for c in colls]
    have = [c for c in colls if len(c)]
    empty_arr = Arrivals(0, {r: 0 for r in ranks}, {r: 0 for r in ranks}, {r: 0.0 for r in ranks},
                         {r: 0.0 for r in ranks}, [])
    if len(have) < 2:
        ref = have[0].rank if have else (ranks[0] if ranks else -1)
        return Alignment(ref, "none (fewer than two ranks with collectives)",
                         {r: 0.0 for r in ranks}, {r: 0.0 for r in ranks}, {r: 0 for r in ranks}), empty_arr
    by_rank = {c.rank: c for c in have}
    # each process group is matched against its own reference: the rank with most of its collectives
    pg_ref, pg_match, order = _match_groups(have)
    # offsets: end-time differences against each group's reference, chained from the global reference
    use_ends = all(c.side != "cpu" for c in have)
    global_ref = max(have, key=lambda c: (len(c), -c.rank)).rank
    offset = {global_ref: 0.0}
    spread = {global_ref: 0.0}
    matched = {global_ref: int(len(by_rank[global_ref]))}
    changed = True
    while changed:
        changed = False
        for p in order:
            ref = pg_ref[p]
            if ref not in offset:
                continue
            a = by_rank[ref]
            ia = pg_match[p][ref]
            for r, ib in pg_match[p].items():
                if r in offset:
                    continue
                ok = ib >= 0
                if not ok.any():
                    continue
                d = (a.end[ia][ok] - by_rank[r].end[ib[ok]]).astype(np.float64)
                offset[r] = offset[ref] + (_median(d) if use_ends else 0.0)
                spread[r] = _mad(d) if use_ends else 0.0
                matched[r] = int(ok.sum())
                changed = True
    method = ("median difference of the end times of matched collectives" if use_ends
              else "none: host-side collectives only (their ends are not simultaneous); clocks taken as shared")
    al = Alignment(global_ref, method, {r: offset.get(r, 0.0) / NS_PER_US for r in ranks},
                   {r: spread.get(r, 0.0) / NS_PER_US for r in ranks}, {r: matched.get(r, 0) for r in ranks})
    # arrival matrix: one column per collective of each group's reference
    idx = {r: i for i, r in enumerate(ranks)}
    am = _arrival_matrix(ranks, by_rank, pg_ref, pg_match, order, offset)
    a, steps_of, col_pg = am["start"], am["step"], am["pg"]
    if columns is not None:
        columns["rank_index"] = {r: am["index"][i] for r, i in idx.items()}
        columns["offset_ns"] = {r: float(offset.get(r, 0.0)) for r in ranks}
    present = ~np.isnan(a)
    n = a.shape[1]
    if n == 0:
        return al, empty_arr
    last, caused = _last_arrivals(a)
    top = np.where(present, a, -np.inf).max(axis=0)
    second = top - caused
    last_count = np.bincount(last, minlength=len(ranks))
    # waits of concurrent collectives overlap in time (a rank that issues two all-reduces waits
    # for both at once): a rank's wait is the union of its waiting intervals, and what a
    # straggler caused is the union of the intervals between the second-last and its arrival
    caused_by = np.zeros(len(ranks))
    waited_by = np.zeros(len(ranks))
    for i in range(len(ranks)):
        mine = (last == i) & (caused > 0)
        caused_by[i] = union(second[mine], top[mine]).total if mine.any() else 0.0
        pres = present[i]
        waited_by[i] = union(a[i, pres], top[pres]).total if pres.any() else 0.0
    worst = [{"collective": int(j), "pg": col_pg[j], "step": int(steps_of[j]), "last_rank": ranks[int(last[j])],
              "caused_us": float(caused[j]) / NS_PER_US} for j in np.argsort(-caused)[:5]]
    arr = Arrivals(n, {r: int(last_count[i]) for r, i in idx.items()},
                   {r: int(present[i].sum()) for r, i in idx.items()},
                   {r: float(caused_by[i]) / NS_PER_US for r, i in idx.items()},
                   {r: float(waited_by[i]) / NS_PER_US for r, i in idx.items()}, worst)
    return al, arr


def _last_arrivals(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of an arrival matrix (NaN: absent): the row that arrived last, and the wait it
    alone caused (last minus second-last arrival; 0 with one arrival)."""
    filled = np.where(~np.isnan(a), a, -np.inf)
    last = np.argmax(filled, axis=0)
    top = filled[last, np.arange(a.shape[1])]
    second = np.partition(filled, -2, axis=0)[-2] if a.shape[0] >= 2 else top
    return last, np.where(np.isfinite(second), top - second, 0.0)


@dataclass
class MatchedCollectives:
    """Every collective matched by at least two ranks, on the aligned clock (the report's
    ``cross_rank.alignment.offset_us``). Arrays are (ranks × collectives) unless noted."""

    ranks: list[int]
    side: dict  # rank -> "gpu" | "kernels" | "cpu"
    pg: list[str]  # per collective
    sig: list[str]  # per collective: "type:elements" (or the type)
    step: np.ndarray  # per collective: step number of the reference rank (-1: none)
    start: np.ndarray  # aligned start ns (NaN: the rank has no match)
    end: np.ndarray  # aligned end ns
    local_start: np.ndarray  # start on the rank's own clock (int64; -1: no match)
    local_end: np.ndarray
    last: np.ndarray  # per collective: row (index into ranks) of the last arrival
    caused_ns: np.ndarray  # per collective: last minus second-last arrival


def matched_collectives(cap: Capture, offset_us: dict) -> MatchedCollectives:
    """Match the collectives of ``cap``'s ranks as :func:`align_and_arrivals` does and put them on
    the clock given by ``offset_us`` (rank or str(rank) -> µs to add to that rank's times)."""
    colls = [rank_collectives(rt) for rt in cap.ranks]
    ranks = [c.rank for c in colls]
    have = [c for c in colls if len(c)]
    by_rank = {c.rank: c for c in have}
    offset = {r: float(offset_us.get(str(r), offset_us.get(r, 0.0)) or 0.0) * NS_PER_US for r in by_rank}
    if len(have) >= 2:
        pg_ref, pg_match, order = _match_groups(have)
        am = _arrival_matrix(ranks, by_rank, pg_ref, pg_match, order, offset)
    else:
        am = _arrival_matrix(ranks, by_rank, {}, {}, [], offset)
    a, ix = am["start"], am["index"]
    n = a.shape[1]
    ls = np.full((len(ranks), n), -1, dtype=np.int64)
    le = np.full((len(ranks), n), -1, dtype=np.int64)
    end = np.full((len(ranks), n), np.nan)
    sig = [""] * n
    for i, r in enumerate(ranks):
        c = by_rank.get(r)
        if c is None:
            continue
        ok = ix[i] >= 0
        ls[i, ok] = c.start[ix[i, ok]]
        le[i, ok] = c.end[ix[i, ok]]
        end[i, ok] = c.end[ix[i, ok]] + offset[r]
        for j in np.nonzero(ok)[0].tolist():
            sig[j] = sig[j] or str(c.sig[ix[i, j]])
    last, caused = _last_arrivals(a) if n else (np.zeros(0, np.int64), np.zeros(0))
    return MatchedCollectives(ranks, {c.rank: c.side for c in colls}, am["pg"], sig, am["step"], a, end, ls, le,
                              last, caused)


# ------------------------------------------------------------------------------ robust outliers
def loo_median(x: np.ndarray) -> np.ndarray:
    """For each column and each row i, the median of the column without row i (vectorised).

    ``x`` is (ranks, metrics). With one row the result is the row itself.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    if n < 2:
        return x.copy()
    order = np.argsort(x, axis=0, kind="stable")
    v = np.take_along_axis(x, order, axis=0)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(n)[:, None].repeat(x.shape[1], axis=1), axis=0)
    m = n - 1

    def kth(k: int) -> np.ndarray:  # k-th smallest of the column without row i
        return np.where(k < pos, v[k][None, :], v[min(k + 1, n - 1)][None, :])

    if m % 2:
        return kth((m - 1) // 2)
    return 0.5 * (kth(m // 2 - 1) + kth(m // 2))


def robust_z(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Modified z-score of every rank (rows) for every metric (columns), leaving the rank out.

    Returns (z, median_of_others, sigma). sigma = max(MAD_TO_SIGMA · MAD, ABNORMAL_NOISE_FLOOR ·
    |median|): the MAD is of the other ranks (exact up to ABNORMAL_EXACT_LOO_MAX ranks; beyond,
    one rank moves the MAD of all by a negligible amount, so the MAD of all ranks is used), and
    the noise floor keeps two or three identical ranks from making any difference infinite.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    med = loo_median(x)
    if n <= 1:
        mad = np.zeros_like(x)
    elif n <= ABNORMAL_EXACT_LOO_MAX:
        mad = np.empty_like(x)
        for i in range(n):
            o = np.delete(x, i, axis=0)
            mad[i] = np.median(np.abs(o - np.median(o, axis=0)), axis=0)
    else:
        mad = np.broadcast_to(np.median(np.abs(x - np.median(x, axis=0)), axis=0), x.shape)
    sigma = np.maximum(MAD_TO_SIGMA * mad, ABNORMAL_NOISE_FLOOR * np.abs(med))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(sigma > 0, (x - med) / sigma, np.where(x > med, np.inf, 0.0))
    return z, med, sigma


def abnormal_mask(x: np.ndarray, min_abs: float = ABNORMAL_MIN_US) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranks (rows) abnormally HIGH in a metric (column): robust z >= ABNORMAL_Z, at least
    ABNORMAL_MIN_REL above the median of the others and at least ``min_abs`` above it.
    Returns (mask, z, median_of_others)."""
    z, med, _ = robust_z(x)
    x = np.asarray(x, dtype=np.float64)
    over = x - med
    mask = (z >= ABNORMAL_Z) & (over >= ABNORMAL_MIN_REL * np.abs(med)) & (over >= min_abs)
    return mask, z, med


# ------------------------------------------------------------------------------------ report
@dataclass
class CrossRank:
    """Everything the report shows about ranks compared with each other (schema in docs/report.md)."""

    ranks: list[int]
    hosts: dict
    world_size: int
    missing_ranks: list[int]
    collective_source: dict  # rank -> "gpu" | "kernels" | "cpu" | ""
    alignment: dict
    arrivals: dict
    classes: dict  # {"names": [...], "time_per_step_us": [[rank x class]], "ratio": [[...]]}
    matrix: dict  # {"ranks", "steps", "step_us", "compute_us", "exposed_comm_us"} (rank x step, None = no step)
    abnormal: list[dict]
    stragglers: list[dict]
    flags: dict = field(default_factory=dict)  # rank -> ["straggler" | "waiting" | "abnormal"]


def _per_step(rep) -> int:
    return max(len(rep.steps), 1)


def class_matrix(reports: list) -> dict:
    """Per rank × per class: time per step and bottleneck ratio (from each rank's hotspots)."""
    names: list[str] = []
    for r in reports:
        for c in r.hotspots.get("classes", []):
            if c["cls"] not in names:
                names.append(c["cls"])
    t = np.zeros((len(reports), len(names)))
    q = np.zeros((len(reports), len(names)))
    col = {n: j for j, n in enumerate(names)}
    for i, r in enumerate(reports):
        for c in r.hotspots.get("classes", []):
            t[i, col[c["cls"]]] = c["time_us"] / _per_step(r)
            q[i, col[c["cls"]]] = c["ratio"]
    return {"names": names, "time_per_step_us": t.round(3).tolist(), "ratio": q.round(5).tolist()}


def step_matrix(reports: list) -> dict:
    """Rank × step matrix of step time, compute and exposed communication (µs; None where a
    rank has no such step) for the UI's heat map."""
    steps = sorted({s.step for r in reports for s in r.steps})
    col = {s: j for j, s in enumerate(steps)}
    out = {"ranks": [r.rank for r in reports], "steps": steps}
    for key, attr in (("step_us", "duration_us"), ("compute_us", "compute_us"), ("exposed_comm_us", "communication_us")):
        m: list[list] = [[None] * len(steps) for _ in reports]
        for i, r in enumerate(reports):
            for s in r.steps:
                m[i][col[s.step]] = round(float(getattr(s, attr)), 3)
        out[key] = m
    return out


def diff_evidence(base: RankTrace, slow: RankTrace) -> dict:
    """What the slow rank's median step does more than the base rank's median step (kernels,
    host gaps, host functions), and how its inputs, collectives, speed on the same work and GPU
    clocks compare (analysis/rankdiff.py). A plain JSON-able dict: workers compute it too."""
    d = diff_captures(base, slow, top=10_000)
    kern = [i for i in d.items if i.kind in ("kernel", "memop") and i.delta_us > 0]
    kern.sort(key=lambda i: -i.delta_us)
    gaps = sorted((i for i in d.items if i.kind == "gap" and i.delta_us > 0), key=lambda i: -i.delta_us)
    host = sorted((i for i in d.host_items if i.delta_us > 0), key=lambda i: -i.delta_us)
    return {
        "step_delta_us": d.delta_us,
        "kernels": [{"name": i.name, "delta_us": i.delta_us, "delta_calls": i.delta_calls,
                     "cls": classify.kernel_class(i.name) if i.kind == "kernel" else "memop"} for i in kern[:5]],
        "host_gaps": [{"name": i.name, "delta_us": i.delta_us, "site": i.site} for i in gaps[:3]],
        "functions": [{"kind": i.kind, "name": i.name, "delta_us": i.delta_us, "delta_calls": i.delta_calls,
                       "base_calls": i.base_calls} for i in host[:5]],
        **rankdiff.compare(base, slow),
    }


def rank_host(rt: RankTrace) -> str:
    """The host a rank ran on, as its trace names it ("" when it does not)."""
    return rt.meta.get("host_name") or rt.meta.get("host") or ""


def cross_rank(cap: Capture, reports: list, diff: bool = True, columns: dict | None = None) -> CrossRank:
    """Compare the ranks of a capture. ``reports`` are the per-rank RankReports, in cap.ranks order;
    ``columns`` receives the collective matching (see :func:`align_and_arrivals`) and each rank's
    :class:`RankCollectives` under ``"collectives"``."""
    colls = [rank_collectives(rt) for rt in cap.ranks]
    differs = (lambda base, slow: diff_evidence(cap.rank(base), cap.rank(slow))) if diff else None
    return cross_rank_of([rt.rank for rt in cap.ranks], {rt.rank: rank_host(rt) for rt in cap.ranks},
                         cap.world_size, colls, reports, differs, columns)


def cross_rank_of(ranks: list[int], hosts: dict, world: int, colls: list[RankCollectives], reports: list,
                  differs: Callable[[int, int], dict] | None = None, columns: dict | None = None,
                  matched: tuple[Alignment, Arrivals] | None = None) -> CrossRank:
    """:func:`cross_rank` from per-rank summaries alone (ranks analysed elsewhere): the ranks in
    order, their hosts, the world size, their collectives and RankReports. ``differs(base_rank,
    slow_rank)`` gives a straggler's diff evidence (none when absent: the caller adds it);
    ``matched`` is :func:`align_and_arrivals`'s result when the caller already has it."""
    missing = sorted(set(range(world)) - set(ranks))
    al, arr = matched if matched is not None else align_and_arrivals(colls, columns)
    if columns is not None:
        columns["collectives"] = {c.rank: c for c in colls}
    classes = class_matrix(reports)
    matrix = step_matrix(reports)
    n_steps = np.array([_per_step(r) for r in reports], dtype=np.float64)
    med_step = float(np.median([r.summary.get("step_median_us", 0.0) if r.summary else 0.0 for r in reports])) \
        if reports else 0.0
    steps_med = float(np.median(n_steps)) if len(n_steps) else 1.0
    # -- stragglers: the ranks whose late arrivals alone cost the others most
    stragglers: list[dict] = []
    flags: dict[int, set] = {}
    total_caused = sum(arr.caused_wait_us.values())
    if arr.collectives and len(ranks) >= 2 and total_caused > 0:
        need = max(STRAGGLER_MIN_WAIT_US, STRAGGLER_MIN_WAIT_SHARE * med_step)
        cand = [r for r in ranks if arr.caused_wait_us[r] / steps_med >= need
                and arr.caused_wait_us[r] >= STRAGGLER_MIN_CAUSED_SHARE * total_caused]
        cand.sort(key=lambda r: -arr.caused_wait_us[r])
        pos = {r: i for i, r in enumerate(ranks)}
        names = classes["names"]
        t = np.array(classes["time_per_step_us"]) if names else np.zeros((len(ranks), 0))
        for r in cand:
            i = pos[r]
            others = [j for j in range(len(ranks)) if ranks[j] not in cand]
            if not others:
                continue
            comp = np.array([rep.summary.get("compute_us", 0.0) / _per_step(rep) if rep.summary else 0.0 for rep in reports])
            med_comp = float(np.median(comp[others]))
            base_i = others[int(np.argmin(np.abs(comp[others] - med_comp)))]
            delta = t[i] - np.median(t[others], axis=0) if names else np.zeros(0)
            by_class = sorted(({"cls": n, "delta_per_step_us": float(d), "rank_us": float(t[i, j]),
                                "median_us": float(np.median(t[others, j]))}
                               for j, (n, d) in enumerate(zip(names, delta)) if not n.startswith(_CAUSE_EXCLUDE) and d > 0),
                              key=lambda e: -e["delta_per_step_us"])
            waiting = sorted((ranks[j] for j in others if arr.waited_us[ranks[j]] > 0),
                             key=lambda q: -arr.waited_us[q])
            work = sum(e["delta_per_step_us"] for e in by_class if e["cls"] in WORK_CLASSES)
            caused_ps = arr.caused_wait_us[r] / steps_med
            # the job loses at most what the others waited for it, and at most its extra work
            # (waits at successive collectives overlap the waiting rank's own compute)
            loss_ps = min(caused_ps, work) if work > 0 else caused_ps
            ev = {
                "straggler_rank": r, "host": hosts.get(r, ""),
                "last_arrivals": arr.last_count[r], "collectives": arr.present[r],
                "caused_wait_us": arr.caused_wait_us[r], "caused_wait_per_step_us": caused_ps, "extra_work_per_step_us": work,
                "loss_per_step_us": loss_ps, "steps": int(steps_med), "loss_us": loss_ps * steps_med,
                "median_step_us": med_step, "share_of_step": loss_ps / med_step if med_step else 0.0,
                "compute_per_step_us": float(comp[i]), "median_compute_per_step_us": med_comp,
                "waiting_ranks": waiting[:16], "waited_us": {str(q): arr.waited_us[q] for q in waiting[:16]},
                "base_rank": ranks[base_i], "by_class": by_class[:5], "missing_ranks": missing,
                "clock": {"method": al.method, "offset_us": al.offset_us.get(r, 0.0), "spread_us": al.spread_us.get(r, 0.0)},
            }
            if differs is not None:
                ev["differs"] = differs(ranks[base_i], ranks[i])
            stragglers.append(ev)
            flags.setdefault(r, set()).add("straggler")
            for q in waiting:
                flags.setdefault(q, set()).add("waiting")
    # -- abnormal workers: work classes and median step time per rank
    abnormal: list[dict] = []
    if len(ranks) >= 2:
        names = [n for n in classes["names"] if n in WORK_CLASSES]
        cols = [classes["names"].index(n) for n in names]
        t = np.array(classes["time_per_step_us"])[:, cols] if cols else np.zeros((len(ranks), 0))
        stepm = np.array([[rep.summary.get("step_median_us", 0.0) if rep.summary else 0.0] for rep in reports])
        x = np.concatenate([t, stepm], axis=1)
        labels = names + ["step time (median)"]
        mask, z, med = abnormal_mask(x)
        for i, j in zip(*np.nonzero(mask)):
            r = ranks[i]
            abnormal.append({"rank": r, "host": hosts.get(r, ""), "metric": labels[j], "value_us": float(x[i, j]),
                             "median_others_us": float(med[i, j]), "z": float(min(z[i, j], 1e9)),
                             "excess_per_step_us": float(x[i, j] - med[i, j]),
                             "excess_rel": float((x[i, j] - med[i, j]) / med[i, j]) if med[i, j] else None,
                             "steps": int(n_steps[i])})
            flags.setdefault(r, set()).add("abnormal")
    return CrossRank(ranks=ranks, hosts={str(k): v for k, v in hosts.items()}, world_size=world, missing_ranks=missing,
                     collective_source={str(c.rank): c.side for c in colls},
                     alignment={k: ({str(r): v for r, v in val.items()} if isinstance(val, dict) else val)
                                for k, val in as_dict(al).items()},
                     arrivals={k: ({str(r): v for r, v in val.items()} if isinstance(val, dict) else val)
                               for k, val in as_dict(arr).items()},
                     classes=classes, matrix=matrix, abnormal=abnormal, stragglers=stragglers,
                     flags={str(k): sorted(v) for k, v in flags.items()})
