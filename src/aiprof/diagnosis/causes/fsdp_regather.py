"""FSDP_REGATHER: FSDP all-gathers each module's parameters a second time, in backward.

Mechanism: ``fully_shard``'s default ``reshard_after_forward=True`` frees a module's gathered
parameters as soon as its forward ends; its backward needs them again, so FSDP all-gathers them
a second time from its pre-backward hook (FSDP1's ``FULL_SHARD``, ZeRO-3). Each re-gather costs
the host FSDP's unshard work (the copy into the all-gather buffer, the collective's launch, the
copy out into the parameters), GPU copies and a collective on the all-gather stream: a step
bound by its GPU compute hides most of it, a step bound by its host pays for all of it.
``reshard_after_forward=False`` keeps the parameters from forward to backward (ZeRO-2), at the
cost of holding every such module's unsharded parameters at once at the end of the forward.

Evidence: FSDP2's own annotations, with or without Python stacks: an ``FSDP::all_gather
(module)`` or ``FSDP::all_gather_copy_out (module)`` on the host that runs inside a backward
function of autograd's engine (where FSDP's pre-backward hook runs) for a module whose
parameters were already gathered earlier in the same step. Fix priced on every rank at once
(the change is the job's) by the joint replay: the host time inside those annotations removed,
with the launches, copies and collectives they issue; with Python stacks, each widened to the
FSDP ``unshard``/``wait_for_unshard`` call around it. FSDP's other Python (its hooks' bookkeeping,
the reshard after forward) is left in: the saving is a lower bound.
"""
from __future__ import annotations

import re

import numpy as np

from aiprof.analysis.intervals import union
from aiprof.diagnosis.causes.common import (
    actions_inside,
    host_collective_bytes,
    inside_intervals,
    ms,
    named_intervals,
    some_of,
)
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import COLL_END, COLL_START
from aiprof.diagnosis.model import GPU_IDLE, Cause, Claim, Place
from aiprof.diagnosis.replay import Edit

CODE = "FSDP_REGATHER"
#: FSDP2's annotations of one module's all-gather and of its copy out (``_fsdp_param_group.py``);
#: the module's name in brackets, none for the root module
_GATHER = re.compile(r"^FSDP::all_gather(_copy_out)?(?: \((.*)\))?$")
#: the autograd engine's op around each backward function (and the hooks that run with it)
_BACKWARD_OP = "autograd::engine::evaluate_function: "
_MIB = float(1 << 20)
#: with Python stacks: FSDP2's methods around those annotations, whose own Python (the parameters'
#: views, the streams' events) the re-gather also costs (``_fsdp_param_group.py``)
_AROUND = re.compile(r"fsdp/_fully_shard/_fsdp_param_group\.py\(\d+\): (unshard|wait_for_unshard)$")


def regathers(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """The rank's re-gathers: (ts, end, tid) of each FSDP all-gather or copy-out annotation run
    in backward for a module already gathered earlier in its step, which of them are the
    all-gathers (not their copy-outs), and the modules' names. Found once per rank (kept in
    ``f.extra``: the job's condition and the detector both ask)."""
    got = f.extra.get("_fsdp_regathers")
    if got is None:
        got = f.extra["_fsdp_regathers"] = _find_regathers(f)
    return got


def _find_regathers(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    an = f.rt.annotations
    empty = np.zeros(0, np.int64)
    if not len(an) or not len(f.steps):
        return empty, empty, empty, empty.astype(bool), []
    host = ~np.asarray(an["gpu"], dtype=bool) if "gpu" in an else np.ones(len(an), bool)
    names = an.strings("name")
    label_ok = np.array([bool(_GATHER.match(s)) for s in names.labels] + [False])
    ok = label_ok[names.codes] & host
    if not ok.any():
        return empty, empty, empty, empty.astype(bool), []
    idx = np.nonzero(ok)[0]
    ts = np.asarray(an["ts"])[idx]
    end = ts + np.asarray(an["dur"])[idx]
    tid = np.asarray(an["tid"])[idx]
    backward = named_intervals(f.rt.ops, lambda s: s.startswith(_BACKWARD_OP))
    in_bw = inside_intervals(ts, tid, backward)
    step = f.steps.index_of(ts)
    seen: set = set()
    again = np.zeros(len(idx), dtype=bool)
    for k in np.argsort(ts, kind="stable"):
        key = (int(step[k]), int(names.codes[idx[k]]))
        if step[k] >= 0 and key in seen and in_bw[k]:
            again[k] = True
        seen.add(key)
    codes = names.codes[idx[again]]
    modules = sorted({(_GATHER.match(names.labels[c]).group(2) or "root") for c in codes})
    gather = np.array([_GATHER.match(names.labels[c]).group(1) is None for c in codes], dtype=bool)
    return ts[again], end[again], tid[again], gather, modules


def _widen(f: RankFacts, ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each re-gather's interval widened to the outermost FSDP ``unshard``/``wait_for_unshard``
    frame around it on its thread, where Python stacks were recorded (unchanged without)."""
    t = f.tree
    m = f.node_mask(lambda s: bool(_AROUND.search(s)))
    if not m.any() or not len(ts):
        return ts, end
    idx = np.nonzero(m)[0]
    fs, fe, ft = t.start[idx], t.end[idx], t.tid[idx]
    ts2, end2 = ts.copy(), end.copy()
    for k in range(len(ts)):
        hit = (ft == tid[k]) & (fs <= ts[k]) & (fe >= end[k])
        if hit.any():
            ts2[k], end2[k] = fs[hit].min(), fe[hit].max()
    return ts2, end2


def _edit(f: RankFacts, ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> Edit:
    """The fix on one rank: the host time inside the re-gather annotations removed, with the
    calls made there (launches, copies) and the GPU ops and collectives they issued."""
    g = f.graph
    e = f.edit(CODE)
    e.gap_remove += f.gap_time_in(union(ts, end))
    acts = actions_inside(f, (ts, end, tid))
    e.cost_remove[acts] = g.cost[acts]
    if g.n_ops:
        e.drop_op |= acts[g.o_action]
    if g.a_coll is not None and g.o_coll is not None and g.n_ops:
        gone = set(np.unique(g.o_coll[e.drop_op & (g.o_coll >= 0)]).tolist())
        marks = np.isin(g.a_kind, (COLL_START, COLL_END)) & np.isin(g.a_coll, list(gone))
        e.no_wait |= marks & (g.a_kind == COLL_END)
        # a host-side marker inside the annotation (the launch's record_param_comms) goes with it
        inside = inside_intervals(g.a_ts, np.full(g.n_actions, -1), (ts, end, np.full(len(ts), -1)))
        e.cost_remove[marks & inside] = g.cost[marks & inside]
    return e


def units_named(modules: list[str]) -> str:
    """FSDP units for a title: a unit of several modules (``fully_shard([m1, m2])``, annotated
    "m1, m2") in brackets, at most ``common.NAMED_MODULES`` of them."""
    return some_of([f"[{m}]" if ", " in m else m for m in modules])


def regather_edit(f: RankFacts) -> Edit | None:
    """This cause's fix on one rank (the re-gathers found, widened to FSDP's frames around them),
    or None when the rank re-gathers nothing."""
    ts, end, tid, _, _ = regathers(f)
    return _edit(f, *_widen(f, ts, end, tid), tid) if len(ts) else None


def gathered_bytes(f: RankFacts, ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> float:
    """Bytes per step all-gathered inside the intervals (ts, end, tid): the all-gathers' outputs,
    from the collectives' host records (for the re-gathers: what the fix keeps from forward to backward)."""
    return host_collective_bytes(f, "AllGather", "out_nelems", (ts, end, tid))


def detect_job(facts: list[RankFacts], pricer) -> list[Cause]:
    """One cause for the job when every rank re-gathers parameters in backward."""
    edits, found = {}, {}
    for f in facts:
        ts, end, tid, gather, modules = regathers(f)
        if not len(ts):
            return []
        edits[f.rank] = regather_edit(f)
        found[f.rank] = (ts, end, tid, gather, modules)
    f0 = facts[0]
    ts, end, tid, gather, modules = found[f0.rank]
    per = max(len(f0.steps), 1)
    gathers = round(int(gather.sum()) / per)
    host_ns = float((end - ts).sum()) / per
    keep = gathered_bytes(f0, ts, end, tid)
    names = units_named(modules)
    memory = (f" ({keep / _MIB:.0f} MiB per rank more at the end of forward, from this trace's all-gathers)"
              if keep else "")
    # a job cause names the symptoms it explains on every rank, amounts only for exposed
    # communication (pipeline.job_claims: what the job stage can know of ranks it has not in hand)
    claims = [Claim(GPU_IDLE, f.rank, 0.0) for f in facts]
    c = Cause(
        code=CODE, rank=None,
        title=(f"FSDP all-gathers {len(modules)} module(s)' parameters again in backward: {gathers} re-gathers "
               f"per step ({names}), {ms(host_ns)} of host time in them on rank {f0.rank}"),
        mechanism=("With reshard_after_forward=True (fully_shard's default; FSDP1's FULL_SHARD) each module's gathered "
                   "parameters are freed when its forward ends and all-gathered again for its backward: a second "
                   "all-gather per module per step, with its host work, copies and collective."),
        # FSDP2's annotations are the evidence: the remedy is FSDP2's (FSDP1 jobs never reach here)
        remedy=("Keep the gathered parameters from forward to backward: fully_shard(module, "
                "reshard_after_forward=False) for these modules, if memory allows" + memory + "."),
        place=Place("collective", f"FSDP all-gather in backward ({names})", "", [], []),
        evidence={"regathers_per_step": gathers, "modules": modules, "host_us_per_step": host_ns / 1e3,
                  "bytes_kept_per_step": keep},
        edit=edits[f0.rank], claims=claims)
    others = {r: e for r, e in edits.items() if r != f0.rank}
    pricer.price(f0, c, None, others)
    return [c]


def has_regathers(f: RankFacts) -> bool:
    """Whether the rank all-gathers in backward what it gathered in forward."""
    return bool(len(regathers(f)[0]))


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer)


DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer"), detect=detect, every_rank=has_regathers)
