"""FSDP_UNIT_HOOKS: FSDP2 wraps the model in many units, and each unit's hooks cost the host
its own work every step.

Mechanism: each ``fully_shard`` unit runs FSDP's hooks around its forward and backward:
pre-forward (all-gather: copy into the buffer, the collective's launch, the copy out into the
parameters), post-forward (reshard), pre-backward (all-gather again, and the next unit's
prefetch), post-backward (copy the gradients in, reduce-scatter, copy out, accumulate). That is
Python and tens of small ops and copies per unit and phase, whatever the unit's size. A step
bound by its GPU hides it; a step bound by its host (few sequences per rank, a small model) pays
it once per unit: with one unit per block, once per block. Fewer, larger units (several blocks
per ``fully_shard``, or the root alone) pay it fewer times, at the cost of memory: a unit's
parameters are all gathered at once, and the root keeps its parameters gathered from forward to
backward (FSDP2's ``reshard_after_forward`` is False for the root).

Evidence: FSDP2's own annotations on the host, with or without Python stacks: ``FSDP::<hook>
(<module>)`` for each unit but the root (the root's carry no module), ``FSDP::backward_prefetch
for <module>``; every rank has at least ``MIN_UNITS`` units besides the root. FSDP1 jobs (its
``FullyShardedDataParallel.*`` annotations) are not covered.

What-if, on every rank at once (the wrapping is the job's), by the joint replay: every unit
merged into the root, as ``fully_shard(model)`` alone: the host time inside the other units'
annotations removed with their calls' own cost and the host waits made there; the re-gathers in
backward (FSDP_REGATHER's) not run, as the root keeps its parameters; every other copy and
collective the units issued still runs on the GPU (the root moves the same bytes), launched when
the host reaches it. The root's own hooks, now moving every parameter, are left as they are: a
larger all-gather at the forward's start, with nothing to hide behind, is not priced (not measured
apart; over a slow interconnect the saving is an upper bound).
"""
from __future__ import annotations

import re

import numpy as np

from aiprof.analysis.intervals import union
from aiprof.diagnosis.causes import fsdp_regather
from aiprof.diagnosis.causes.common import actions_inside, ms, named_intervals
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import GPU_IDLE, Cause, Claim, Place
from aiprof.diagnosis.replay import Edit

CODE = "FSDP_UNIT_HOOKS"
#: FSDP2's annotations of a unit's hooks and collectives (``_fsdp_state.py``, ``_fsdp_param_group.py``):
#: the unit's module in brackets (none for the root), or named after "for" (the backward prefetch)
_UNIT_HOOK = re.compile(r"^FSDP::(?:\w+ \((?P<m>.+)\)|backward_prefetch for (?P<p>.+))$")
#: units besides the root, at least: what merging saves is a multiple of one unit's hooks, and a
#: job of one unit besides the root was not measured
MIN_UNITS = 2
_MIB = float(1 << 20)


def unit_hooks(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(ts, end, tid) of the rank's host annotations of units other than the root, and the
    units' module names. Found once per rank (kept in ``f.extra``)."""
    got = f.extra.get("_fsdp_unit_hooks")
    if got is None:
        got = f.extra["_fsdp_unit_hooks"] = _find(f)
    return got


def _find(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    an = f.rt.annotations
    empty = np.zeros(0, np.int64)
    if not len(an) or not len(f.steps):
        return empty, empty, empty, []
    host = ~np.asarray(an["gpu"], dtype=bool) if "gpu" in an else np.ones(len(an), bool)
    names = an.strings("name")
    matches = [_UNIT_HOOK.match(s) for s in names.labels]
    label_ok = np.array([m is not None for m in matches] + [False])
    ok = label_ok[names.codes] & host
    if not ok.any():
        return empty, empty, empty, []
    seen = set(np.unique(names.codes[ok]).tolist())
    modules = sorted({m.group("m") or m.group("p") for c, m in enumerate(matches) if m is not None and c in seen})
    ts = np.asarray(an["ts"])[ok]
    return ts, ts + np.asarray(an["dur"])[ok], np.asarray(an["tid"])[ok], modules


def has_units(f: RankFacts) -> bool:
    """Whether the rank runs at least ``MIN_UNITS`` FSDP2 units besides the root."""
    return len(unit_hooks(f)[3]) >= MIN_UNITS


def _edit(f: RankFacts, ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> Edit:
    """The merge on one rank: the host time inside the units' hooks removed with the calls made
    there (their GPU work still launched) and their waits, and the re-gathers not run."""
    g = f.graph
    e = f.edit(CODE)
    e.gap_remove += f.gap_time_in(union(ts, end))
    acts = actions_inside(f, (ts, end, tid))
    e.cost_remove[acts] = g.cost[acts]
    e.no_wait |= acts & (g.a_wait >= 0)
    r = fsdp_regather.regather_edit(f)
    if r is not None:
        # the root keeps what it gathered in forward: the re-gathers' copies and collectives go
        # (their host time is inside the units' hooks, removed above)
        e.drop_op |= r.drop_op
        e.no_wait |= r.no_wait
        e.cost_remove = np.maximum(e.cost_remove, r.cost_remove)
    return e


def _forward_gathered_bytes(f: RankFacts) -> float:
    """Bytes per step the units all-gather in forward (inside their pre-forward hooks): what a
    single unit would hold gathered at once besides the root's own."""
    ts, end, tid = named_intervals(f.rt.annotations, lambda s: s.startswith("FSDP::pre_forward ("))
    return fsdp_regather.gathered_bytes(f, ts, end, tid) if len(ts) else 0.0


def detect_job(facts: list[RankFacts], pricer) -> list[Cause]:
    """One cause for the job when every rank runs several FSDP2 units."""
    edits = {}
    for f in facts:
        ts, end, tid, modules = unit_hooks(f)
        if len(modules) < MIN_UNITS:
            return []
        edits[f.rank] = _edit(f, ts, end, tid)
    f0 = facts[0]
    ts, end, _, modules = unit_hooks(f0)
    per = max(len(f0.steps), 1)
    host_ns = union(ts, end).total / per
    gathered = _forward_gathered_bytes(f0)
    names = fsdp_regather.units_named(modules)
    memory = (f": {gathered / _MIB:.0f} MiB of parameters per rank gathered at once instead of one unit's "
              "(this trace's forward all-gathers), and their gradients unsharded until the reduce-scatter"
              if gathered else "")
    claims = [Claim(GPU_IDLE, f.rank, 0.0) for f in facts]
    c = Cause(
        code=CODE, rank=None,
        title=(f"FSDP runs its hooks for {len(modules)} units besides the root ({names}): {ms(host_ns)} "
               f"of host time per step in them on rank {f0.rank} as recorded (under the profiler)"),
        mechanism=("Each fully_shard unit runs FSDP's hooks around its forward and backward (all-gather with its "
                   "copies in and out, reshard, reduce-scatter with its copies, gradient accumulation): Python and "
                   "small ops on the host whatever the unit's size, paid once per unit every step. On a step bound "
                   "by its host, one unit per block pays them once per block."),
        remedy=("Shard in fewer, larger units: call fully_shard on groups of blocks instead of each block (a list "
                "is one unit: fully_shard(list(blocks[i:i + k]))), or on the root alone, if memory allows" + memory
                + ". Priced: "
                "every unit merged into the root; each unit removed saves about its share. Or give each rank "
                "more work per step (more sequences per rank), which hides the hooks behind the GPU."),
        place=Place("collective", f"FSDP hooks of {len(modules)} units ({names})", "", [], []),
        evidence={"units": len(modules), "modules": modules, "hook_host_us_per_step": host_ns / 1e3,
                  "forward_gathered_bytes_per_step": gathered},
        edit=edits[f0.rank], claims=claims)
    others = {r: e for r, e in edits.items() if r != f0.rank}
    pricer.price(f0, c, None, others)
    return [c]


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer)


DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer"), detect=detect, every_rank=has_units)
