"""FSDP_NO_BACKWARD_PREFETCH: FSDP1 all-gathers a unit's parameters for its backward only once
the backward reaches it (``backward_prefetch=None``), behind the reduce-scatter of the unit before.

Mechanism: NCCL runs the collectives of a process group one at a time, in the order they were
issued, whatever CUDA stream each is on (FSDP's ``BackwardPrefetch`` docstring). With
``backward_prefetch=None`` FSDP1's pre-backward hook of unit i issues unit i's all-gather when
autograd reaches unit i, after unit i+1's post-backward hook issued its reduce-scatter: the
all-gather waits for that reduce-scatter and unit i's backward for the all-gather, so the
collectives idle while a unit computes and the unit waits while they run. ``BACKWARD_PRE`` (the
default) issues it from unit i+1's pre-backward hook: it runs under unit i+1's backward compute,
at the cost of one more unit's unsharded parameters held at a time. ``BACKWARD_POST`` issues it
from unit i+1's post-backward hook, ahead of the reduce-scatter but after unit i+1's compute: it
measured within noise of ``BACKWARD_PRE`` (docs/findings.md), so it is not a cause.

Evidence: FSDP1's own annotations. Backward all-gathers issued on demand are the NCCL AllGather
kernels launched inside ``FullyShardedDataParallel._pre_backward_hook`` but not inside a prefetch
annotation (``_pre_backward_prefetch``, ``_post_backward_prefetch``); on every rank at least
``MIN_GATHERS_PER_STEP`` of them a step and no all-gather launched inside a prefetch annotation
(with prefetching on, every backward all-gather but a step's first is).

What-if, on every rank at once (the setting is the job's), by the joint replay: each backward
all-gather issued where ``BACKWARD_PRE`` issues it, at the prefetch point of the pre-backward hook
before its own (the last call before that hook's ``_pre_backward_prefetch``); the NCCL kernels of
the window run one at a time in their new issue order; the ops that waited for a moved all-gather
wait for it alone (FSDP makes the compute stream wait for the all-gather's stream; the graph's
other waits of that op are its guess that a wait may be on any stream). FSDP's host work stays
where it was: only the order of the collectives changes.
"""
from __future__ import annotations

import numpy as np

from aiprof.diagnosis.causes.common import inside_intervals, ms, named_intervals
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import GPU_IDLE, Cause, Claim, Place
from aiprof.diagnosis.replay import Edit, issue_order
from aiprof.trace.classify import COMMUNICATION, collective_type

CODE = "FSDP_NO_BACKWARD_PREFETCH"
#: FSDP1's record_function names (torch/distributed/fsdp/_runtime_utils.py)
_HOOK = "FullyShardedDataParallel._pre_backward_hook"
_PREFETCH = "FullyShardedDataParallel._pre_backward_prefetch"
_PREFETCHES = (_PREFETCH, "FullyShardedDataParallel._post_backward_prefetch")
#: on-demand backward all-gathers a step, at least: a step's first has no reduce-scatter of an
#: earlier unit to queue behind, so one alone loses nothing to the order
MIN_GATHERS_PER_STEP = 2


def _comm_ops(f: RankFacts) -> tuple[np.ndarray, np.ndarray]:
    """The graph's NCCL kernels (ops, in issue order; the ingest's class of each kernel) and which
    of them are all-gathers."""
    g, k = f.graph, f.rt.kernels
    kern = np.nonzero(g.o_table == 0)[0]
    if not len(kern) or not len(k):
        return np.zeros(0, np.int64), np.zeros(0, bool)
    comm = kern[k.strings("cls").isin_labels(lambda s: s == COMMUNICATION)[g.o_row[kern]]]
    names = k.strings("name")
    gather = np.array([collective_type(names.labels[c]) == "AllGather" for c in names.codes[g.o_row[comm]]], bool)
    return comm.astype(np.int64), gather


def backward_gathers(f: RankFacts) -> dict:
    """The rank's backward all-gathers issued on demand: ``ops`` (their NCCL kernels, in issue
    order), ``at`` (the action where BACKWARD_PRE would issue each, -1 where no hook comes before
    it) and ``prefetched`` (how many all-gathers were issued from a prefetch annotation instead).
    Found once per rank (``f.extra``)."""
    got = f.extra.get("_fsdp_backward_gathers")
    if got is None:
        got = f.extra["_fsdp_backward_gathers"] = _find(f)
    return got


def _find(f: RankFacts) -> dict:
    none = {"ops": np.zeros(0, np.int64), "at": np.zeros(0, np.int64), "prefetched": 0}
    g, an = f.graph, f.rt.annotations
    if not len(an) or not g.n_ops:
        return none
    hooks = named_intervals(an, lambda s: s == _HOOK)
    if not len(hooks[0]):
        return none
    comm, gather = _comm_ops(f)
    ag = comm[gather]
    if not len(ag):
        return none
    rt = f.rt.runtime
    a_ts, a_tid = np.asarray(rt["ts"]), np.asarray(rt["tid"])
    rows = g.a_row[g.o_action[ag]]
    ts, tid = a_ts[rows], a_tid[rows]
    in_hook = inside_intervals(ts, tid, hooks)
    prefetched = inside_intervals(ts, tid, named_intervals(an, lambda s: s in _PREFETCHES))
    ops = ag[in_hook & ~prefetched]
    at = np.full(len(ops), -1, np.int64)
    # each hook's prefetch point: the last action of its thread before its _pre_backward_prefetch
    # (BACKWARD_PRE's); an all-gather goes to the point of the last hook that ended before it was
    # issued: the hook of the unit after its own (its own hook is still open when it issues it)
    p_ts, _, p_tid = named_intervals(an, lambda s: s == _PREFETCH)
    h_ts, h_end, h_tid = hooks
    real = np.nonzero(g.a_row >= 0)[0]
    r_ts, r_tid = a_ts[g.a_row[real]], a_tid[g.a_row[real]]
    step_of = f.steps.index_of
    for k, j in enumerate(ops.tolist()):
        t, th = int(a_ts[g.a_row[g.o_action[j]]]), int(a_tid[g.a_row[g.o_action[j]]])
        before = np.nonzero((h_tid == th) & (h_end <= t))[0]
        if not len(before):
            continue
        h = before[np.argmax(h_ts[before])]
        if step_of(np.array([h_ts[h]]))[0] != step_of(np.array([t]))[0]:
            continue
        inside = np.nonzero((p_tid == th) & (p_ts >= h_ts[h]) & (p_ts <= h_end[h]))[0]
        point = p_ts[inside].min() if len(inside) else h_end[h]
        cand = real[(r_tid == th) & (r_ts < point)]
        if len(cand) and cand[-1] < g.o_action[j]:
            at[k] = cand[-1]
    return {"ops": ops, "at": at, "prefetched": int(prefetched.sum())}


def _edit(f: RankFacts) -> Edit:
    """BACKWARD_PRE on one rank: the all-gathers issued at the prefetch points, the NCCL kernels
    one at a time in their new order, each moved all-gather's consumers waiting for it alone."""
    g = f.graph
    e = f.edit(CODE)
    found = backward_gathers(f)
    moved = {int(j): int(a) for j, a in zip(found["ops"].tolist(), found["at"].tolist()) if a >= 0}
    e.launch_at = moved
    issue = np.empty(g.n_ops, np.int64)
    issue[issue_order(g, moved)] = np.arange(g.n_ops)  # each op's place in the new order
    comm, _ = _comm_ops(f)
    comm = comm[np.argsort(issue[comm], kind="stable")]
    deps: dict[int, list[int]] = {}
    for k, j in enumerate(comm.tolist()):
        # a kernel waits only for work issued before it (an event records what was issued), and
        # for the collective issued before it on another stream (one at a time, in issue order)
        keep = [d for d in g.o_deps.get(j, []) if issue[d] < issue[j]]
        if k and g.o_stream[comm[k - 1]] != g.o_stream[j] and int(comm[k - 1]) not in keep:
            keep.append(int(comm[k - 1]))
        deps[j] = keep
    for j, ds in g.o_deps.items():
        waited = [d for d in ds if d in moved]
        if waited and j not in deps:
            deps[j] = waited
    e.deps = deps
    return e


def has_unprefetched_gathers(f: RankFacts) -> bool:
    """Whether the rank's FSDP1 backward issues its all-gathers on demand, none prefetched."""
    found = backward_gathers(f)
    per = max(len(f.steps), 1)
    return (not found["prefetched"] and len(found["ops"]) >= MIN_GATHERS_PER_STEP * per
            and bool((found["at"] >= 0).any()))


def detect_job(facts: list[RankFacts], pricer) -> list[Cause]:
    """One cause for the job when no rank prefetches its backward all-gathers."""
    if not facts or not all(has_unprefetched_gathers(f) for f in facts):
        return []
    edits = {f.rank: _edit(f) for f in facts}
    f0 = facts[0]
    per = max(len(f0.steps), 1)
    found = backward_gathers(f0)
    gathers = round(len(found["ops"]) / per)
    g0, ops = f0.graph, found["ops"]
    waited_ns = float(np.maximum(g0.o_ts[ops] - g0.a_ts[g0.o_action[ops]], 0).sum()) / per
    claims = [Claim(GPU_IDLE, f.rank, 0.0) for f in facts]
    title = (f"FSDP issues each unit's backward all-gather only when its backward starts: {gathers} all-gathers "
             f"per step queue behind the previous unit's reduce-scatter ({ms(waited_ns)} from issue to start "
             f"on rank {f0.rank})")
    c = Cause(
        code=CODE, rank=None, title=title,
        mechanism=("NCCL runs a process group's collectives one at a time in the order they are issued. With "
                   "backward_prefetch=None, FSDP issues unit i's all-gather from its own pre-backward hook, after "
                   "unit i+1 issued its reduce-scatter: the all-gather waits for that reduce-scatter and unit i's "
                   "backward waits for the all-gather, so communication and compute take turns."),
        remedy=("Prefetch the next unit's parameters from the pre-backward hook: FullyShardedDataParallel(..., "
                "backward_prefetch=BackwardPrefetch.BACKWARD_PRE) (the default; one more unit's unsharded "
                "parameters are held at a time), or move to FSDP2 (fully_shard), which prefetches in backward."),
        place=Place("collective", "FSDP all-gather in backward (FullyShardedDataParallel._pre_backward_hook)",
                    "", [], []),
        evidence={"backward_gathers_per_step": gathers, "backward_prefetch": "None",
                  "issue_to_start_us_per_step": waited_ns / 1e3},
        edit=edits[f0.rank], claims=claims)
    pricer.price(f0, c, None, {r: e for r, e in edits.items() if r != f0.rank})
    return [c]


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer)


DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer"), detect=detect, every_rank=has_unprefetched_gathers)
