"""Several ranks: collectives couple the replays, and the straggler's cause explains the waits.

A collective ends once every rank has arrived plus its transfer time (the last arriver's own
duration), so a rank that arrives late makes every other rank wait. The joint replay advances
every rank's replay in step, each to its next collective, and releases a collective once all
ranks have reached it: a fix on one rank then shows up as the waiting it removes on all the
others, however far the recorded arrivals were from the replayed ones. The job's step is the
slowest rank's (the ranks of one job cannot drift apart).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.steps import Steps
from aiprof.diagnosis.facts import RankFacts, fit_deflation, typical_step_ns
from aiprof.diagnosis.graph import STEP, RankCollectives, build_graph
from aiprof.diagnosis.replay import Edit, ReplayResult, Trace, simulate

# Above this many ranks a fix is priced on its own rank with the others' arrivals as recorded
# (the others are unchanged by it), not by the joint replay: its cost grows with ranks x causes,
# and at 16 ranks it costs what the Ray path does (bench/scale.py: 10.3 s vs 11.0 s; 32 ranks:
# 33.2 s vs 13.9 s), so `analyze` goes to Ray from 17 (scale/engines.py RAY_MIN_RANKS).
JOINT_MAX_RANKS = 16


def _host_comm_ends(rt, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """When each host-side collective's communication ended: a backend thread copies the tensor
    off the GPU, waits for the peers (the longest quiet gap among its calls inside the
    collective) and copies the result back; the communication ends at the first call after that
    gap (the collective's end when it made no calls)."""
    a, r = rt.annotations, rt.runtime
    out = end.copy()
    if not len(a) or not len(r):
        return out
    tid_of = dict(zip(a["ts"].tolist(), a["tid"].tolist()))
    rts, rtid = r["ts"], r["tid"]
    order = np.argsort(rts, kind="stable")
    rts, rtid = rts[order], rtid[order]
    for k, (s0, e0) in enumerate(zip(start, end)):
        tid = tid_of.get(int(s0))
        lo, hi = np.searchsorted(rts, s0), np.searchsorted(rts, e0)
        ts = rts[lo:hi][rtid[lo:hi] == tid] if tid is not None else rts[:0]
        if len(ts) >= 2:
            gaps = np.diff(ts)
            out[k] = ts[int(np.argmax(gaps)) + 1]
    return out


def comm_ends(rt, rc) -> np.ndarray:
    """When each of the rank's collectives (an analysis.ranks.RankCollectives) ended its
    communication: a host backend's from its calls (see :func:`_host_comm_ends`), else its end."""
    return _host_comm_ends(rt, rc.start, rc.end) if rc.side == "cpu" else rc.end


def coupling(columns: dict, ends: dict[int, np.ndarray]) -> dict[int, RankCollectives]:
    """Each rank's matched collectives with the coupling facts: the other ranks' latest arrival
    (on this rank's clock) and the transfer time (the fastest rank's start-to-end). ``columns``
    is the cross-rank matching (analysis.ranks.align_and_arrivals) with each rank's collectives;
    ``ends`` is :func:`comm_ends` per rank. Needs only these arrays, not the traces, so a driver
    can compute it for ranks analysed elsewhere. Empty when fewer than two ranks match."""
    idx = columns.get("rank_index") or {}
    colls = columns.get("collectives") or {}
    off = columns.get("offset_ns") or {}
    if not idx or not colls:
        return {}
    ranks = [r for r in ends if r in idx and r in colls]
    if len(ranks) < 2:
        return {}
    n_col = len(next(iter(idx.values())))
    start = np.full((len(ranks), n_col), np.nan)
    end = np.full((len(ranks), n_col), np.nan)
    for i, r in enumerate(ranks):
        ix = idx[r]
        ok = ix >= 0
        start[i, ok] = colls[r].start[ix[ok]] + off.get(r, 0.0)
        end[i, ok] = ends[r][ix[ok]] + off.get(r, 0.0)
    with np.errstate(invalid="ignore"):
        transfer = np.nanmin(end - start, axis=0)
    # the latest arrival of the others: the column's latest, or its second latest for the rank
    # that arrived latest (one pass for all ranks: a thousand ranks cannot each copy the matrix)
    filled = np.where(np.isnan(start), -np.inf, start)
    top = np.argmax(filled, axis=0) if len(ranks) else np.zeros(n_col, np.int64)
    first = filled[top, np.arange(n_col)]
    second = np.partition(filled, -2, axis=0)[-2]
    out = {}
    for i, r in enumerate(ranks):
        ix = idx[r]
        ok = np.nonzero(ix >= 0)[0]
        latest = np.where(top == i, second, first)
        latest = np.where(np.isfinite(latest), latest, np.nan)
        have = ok[~np.isnan(latest[ok]) & ~np.isnan(transfer[ok])]
        rc = colls[r]
        out[r] = RankCollectives(ids=have.astype(np.int64), start=rc.start[ix[have]], end=ends[r][ix[have]],
                                 host=rc.side == "cpu",
                                 others={int(c): float(latest[c] - off.get(r, 0.0)) for c in have},
                                 transfer={int(c): float(max(transfer[c], 0.0)) for c in have})
    return out


def attach_collectives(facts: list[RankFacts], columns: dict) -> bool:
    """Rebuild each rank's graph with its matched collectives and recalibrate it; False when
    the job has no matched collectives (the ranks are then priced independently)."""
    colls = columns.get("collectives") or {}
    ends = {f.rank: comm_ends(f.rt, colls[f.rank]) for f in facts if f.rank in colls}
    rcols = coupling(columns, ends)
    if not rcols:
        return False
    off = columns.get("offset_ns") or {}
    for f in facts:
        if f.rank in rcols:
            f.graph = build_graph(f.rt, window_steps(f), f.graph.profiler, rcols[f.rank])
            f.extra["offset_ns"] = off.get(f.rank, 0.0)
    settle([f for f in facts if f.rank in rcols])
    return True


def unprofiled_target_ns(steps_ns: list[float | None]) -> float | None:
    """The unprofiled step a coupled job's replay is fitted to: the median of its ranks' measured
    ones (each rank's agent times its own iterations); None when no rank has one."""
    known = [v for v in steps_ns if v]
    return float(np.median(known)) if known else None


def settle(coupled: list[RankFacts], target_ns: float | None = None) -> None:
    """Calibrate coupled ranks together to ``target_ns``, the job's unprofiled step (default: the
    median of these ranks' unprofiled steps, where known; analysed rank by rank, the ranks in
    hand are a pair and the driver passes the job's, :func:`unprofiled_target_ns` of every rank),
    and set each one's baseline to the joint replay."""
    target = target_ns or unprofiled_target_ns([f.unprofiled_step_ns for f in coupled])
    scale = calibrate_joint(coupled, target) if target else (1.0, 1.0)
    res = joint_replay(coupled, traced=True)  # traced: each rank's critical path walks back through it
    for f in coupled:
        f.host_scale = scale
        f.base = res[f.rank]


def calibrate_joint(facts: list[RankFacts], target_step_ns: float) -> tuple[float, float]:
    """One deflation for all coupled ranks so that the joint replay's job step matches the
    unprofiled step the agents measured (each rank's alone cannot: it would wait for the others'
    recorded, still profiled, arrivals)."""
    def at(alpha: float, beta: float) -> float:
        for f in facts:
            f.graph.deflate(alpha, beta)
        res = joint_replay(facts)
        return max(typical_step_ns(res[f.rank], f.extra.get("outliers")) for f in facts)

    return fit_deflation(at, target_step_ns)


def window_steps(f: RankFacts) -> Steps:
    """The steps of the rank's current replay window (see engine.replay_window)."""
    keep = np.isin(f.steps.number, f.graph.step_number)
    return Steps(f.steps.number[keep], f.steps.start[keep], f.steps.end[keep], f.steps.source)


def start_offsets(facts: list[RankFacts]) -> dict[int, float]:
    """Per rank, the ns to add to its clock so that every rank starts the replay's first common
    step at the same instant (steps are numbered alike on every rank: the profiler's schedule
    counts them). Recorded, the ranks' step starts differ by what the slow ranks made the others
    do: a rank that only waits on the GPU runs its host up to a step ahead of a straggler, and
    keeping that offset would keep the waiting it stands for after the straggler's fix. Without
    a common step, the clock offsets of the cross-rank matching."""
    common = set.intersection(*(set(f.graph.step_number.tolist()) for f in facts)) if facts else set()
    if not common:
        return {f.rank: f.extra.get("offset_ns", 0.0) for f in facts}
    first = min(common)
    out = {}
    for f in facts:
        g = f.graph
        starts = g.a_ts[g.a_kind == STEP]
        k = int(np.nonzero(g.step_number == first)[0][0])
        out[f.rank] = -float(starts[k]) if k < len(starts) else f.extra.get("offset_ns", 0.0)
    return out


def joint_replay(facts: list[RankFacts], edits: dict[int, Edit] | None = None,
                 traced: bool = False) -> dict[int, ReplayResult]:
    """Replay every rank together (see the module docstring): each rank runs until it reaches a
    collective, and a collective is released to a rank once every other rank whose window holds
    it has arrived there. Ranks waiting on each other in an order no schedule can satisfy (their
    windows cut the collectives differently) are released in arrival order with the recorded
    arrivals of the missing ranks. ``traced``: each result keeps its replay's Trace."""
    edits = edits or {}
    off = start_offsets(facts)
    holders: dict[int, set] = {}  # collective -> the ranks whose replay reaches it
    for f in facts:
        g = f.graph
        for ids in (g.o_coll, g.a_coll):
            if ids is not None:
                for c in np.unique(ids[ids >= 0]).tolist():
                    if c in g.c_transfer:
                        holders.setdefault(c, set()).add(f.rank)
    sims = {f.rank: simulate(f.graph, edits.get(f.rank), trace=Trace() if traced else None) for f in facts}
    graphs = {f.rank: f.graph for f in facts}
    res: dict[int, ReplayResult] = {}
    waiting: dict[int, tuple[int, float]] = {}  # rank -> (collective, arrival on its clock)
    arrived: dict[int, dict[int, float]] = {}  # collective -> rank -> arrival (common clock)

    def advance(r: int, value: float | None) -> None:
        try:
            c, t = next(sims[r]) if value is None else sims[r].send(value)
        except StopIteration as done:
            res[r] = done.value
            return
        waiting[r] = (c, t)
        arrived.setdefault(c, {})[r] = t + off[r]

    def latest_other(r: int, c: int) -> float | None:
        """The others' latest arrival at c on r's clock, once all holders arrived (else None)."""
        here = arrived.get(c, {})
        others = holders.get(c, set()) - {r}
        if not others:
            return graphs[r].c_others.get(c, waiting[r][1])
        if not others <= here.keys():
            return None
        return max(here[q] for q in others) - off[r]

    for r in sims:
        advance(r, None)
    while waiting:
        ready = [(r, v) for r, (c, _) in waiting.items() if (v := latest_other(r, c)) is not None]
        if not ready:  # a cycle: release the earliest arrival with what is known of the others
            r = min(waiting, key=lambda q: waiting[q][1] + off[q])
            c, t = waiting[r]
            known = [v - off[r] for q, v in arrived.get(c, {}).items() if q != r]
            ready = [(r, max(known + [graphs[r].c_others.get(c, t)]))]
        for r, v in ready:
            del waiting[r]
            advance(r, v)
    return res


def job_step_ns(res: dict[int, ReplayResult]) -> float:
    """The job's mean step: the slowest rank's."""
    return max(r.per_step_ns for r in res.values()) if res else 0.0
