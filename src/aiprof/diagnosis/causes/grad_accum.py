"""GRAD_ACCUM_ALLREDUCE: gradient accumulation that all-reduces after every micro-batch.

Mechanism: DDP all-reduces the gradients at the end of every backward pass. With gradient
accumulation only the last micro-batch's all-reduce is needed (the others' sums are overwritten
by it); ``model.no_sync()`` around the other micro-batches skips them. Without it every
micro-batch pays a full all-reduce, on every rank.

Evidence: several backward passes per step, with collectives after more than one of them. Fix
priced on every rank at once (a code change the whole job makes) by the joint replay: the
collectives of all but the last backward pass of each step skipped.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import PYTHON
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import COLL_END
from aiprof.diagnosis.model import EXPOSED_COMM, WAITING_RANK, Cause, Claim, Place

CODE = "GRAD_ACCUM_ALLREDUCE"
_BACKWARD = "<built-in method run_backward"


def _skippable(f: RankFacts) -> tuple[np.ndarray, np.ndarray, int]:
    """(skippable host COLL_END actions, skippable GPU collective ops, backward passes per step)."""
    g = f.graph
    bw = f.node_mask(lambda s: s.startswith(_BACKWARD), (PYTHON,))
    z = np.zeros(g.n_actions, dtype=bool), np.zeros(g.n_ops, dtype=bool), 0
    if not bw.any() or g.a_coll is None:
        return z
    starts = np.sort(f.tree.start[bw])
    step_of_bw = f.steps.index_of(starts)
    per_step = np.bincount(step_of_bw[step_of_bw >= 0], minlength=len(f.steps))
    if not len(per_step) or per_step.max() < 2:
        return z
    # a collective belongs to the last backward pass that started before it
    def pass_of(ts: np.ndarray) -> np.ndarray:
        return np.searchsorted(starts, ts, side="right") - 1

    last_of_step = {}
    for k, s in enumerate(step_of_bw):
        if s >= 0:
            last_of_step[s] = k
    skip_a = np.zeros(g.n_actions, dtype=bool)
    ends = np.nonzero(g.a_kind == COLL_END)[0]
    if len(ends):
        starts_of = {int(c): t for c, t in zip(g.a_coll, g.a_ts) if c >= 0}
        cs = np.array([starts_of.get(int(g.a_coll[i]), g.a_ts[i]) for i in ends])
        pk = pass_of(cs)
        st = f.steps.index_of(cs)
        skip_a[ends] = (pk >= 0) & (st >= 0) & np.array([last_of_step.get(int(s), -1) != int(p) for s, p in zip(st, pk)])
    skip_o = np.zeros(g.n_ops, dtype=bool)
    co = np.nonzero(g.o_coll >= 0)[0] if g.o_coll is not None else np.zeros(0, np.int64)
    if len(co):
        lt = g.a_ts[g.o_action[co]]
        pk, st = pass_of(lt), f.steps.index_of(lt)
        skip_o[co] = (pk >= 0) & (st >= 0) & np.array([last_of_step.get(int(s), -1) != int(p) for s, p in zip(st, pk)])
    return skip_a, skip_o, int(np.median(per_step[per_step > 0]))


def detect_job(facts: list[RankFacts], pricer) -> list[Cause]:
    """One cause for the job when every rank all-reduces after more than one backward pass."""
    edits, counts = {}, {}
    for f in facts:
        a, o, passes = _skippable(f)
        if not (a.any() or o.any()):
            return []
        e = f.edit(CODE)
        e.no_wait |= a
        e.drop_op |= o
        edits[f.rank] = e
        counts[f.rank] = (int(a.sum() + o.sum()) / max(len(f.steps), 1), passes)
    f0 = facts[0]
    skipped, passes = counts[f0.rank]
    total = sum(len(f.graph.c_transfer) for f in facts[:1]) / max(len(f0.steps), 1)
    claims = [Claim(EXPOSED_COMM, f.rank, float(sum(b.communication_us for b in f.breakdown))) for f in facts]
    claims += [Claim(WAITING_RANK, f.rank, 0.0) for f in facts]
    c = Cause(
        code=CODE, rank=None,
        title=(f"gradient accumulation all-reduces after every micro-batch: {passes} backward passes per step, "
               f"{skipped:.0f} of {total:.0f} collectives per step are not needed"),
        mechanism=("DDP all-reduces the gradients at the end of every backward pass; with gradient accumulation only "
                   "the last micro-batch's reduction is needed, the others move the whole gradient for nothing."),
        remedy=("Wrap every micro-batch but the last in `with model.no_sync():` (forward and backward), so DDP "
                "all-reduces once per optimizer step; with FSDP, use `model.no_sync()` the same way or "
                "set `require_backward_grad_sync=False` on those micro-batches."),
        place=Place("collective", "DDP all-reduce (every micro-batch)", "", [], []),
        evidence={"backward_passes_per_step": passes, "skippable_collectives_per_step": skipped,
                  "collectives_per_step": total},
        edit=edits[f0.rank], claims=claims)
    others = {r: e for r, e in edits.items() if r != f0.rank}
    pricer.price(f0, c, None, others)
    return [c]


def skippable(f: RankFacts) -> bool:
    """Whether the rank all-reduces after a backward pass that is not its step's last."""
    a, o, _ = _skippable(f)
    return bool(a.any() or o.any())


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer)


DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer"), detect=detect, every_rank=skippable)
