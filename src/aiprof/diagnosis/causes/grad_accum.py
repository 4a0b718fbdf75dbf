"""GRAD_ACCUM_ALLREDUCE: gradient accumulation that reduces the gradients after every micro-batch.

Mechanism: data parallelism reduces the gradients at the end of every backward pass: DDP
all-reduces them in buckets; FSDP reduce-scatters each unit's (FSDP2's post-backward hook: the
gradients copied into one buffer, the reduce-scatter, the shard copied out and accumulated).
With gradient accumulation only the last micro-batch's reduction is needed: the others move the
whole gradient for a sum the last one would make anyway. DDP's and FSDP1's ``model.no_sync()``
and FSDP2's ``model.set_requires_gradient_sync(False)`` skip them; FSDP then keeps each unit's
unsharded gradient until the last micro-batch (memory: the reduce-scatters' inputs).

Evidence: several backward passes per step (torch's ``run_backward`` in the Python stacks), and
gradient reductions (AllReduce or ReduceScatter kernels) launched inside a backward pass that is
not its step's last. All-gathers are not reductions: FSDP gathers the parameters for every
micro-batch's forward and backward either way.

What-if, on every rank at once (the fix is the job's) by the joint replay: the reductions
launched in those passes not run and not waited for. The host work around them and their copies
stay: with the fix, DDP's hooks and FSDP's post-backward still run, and FSDP accumulates each
micro-batch's unsharded gradients instead (an add per parameter), work of the same kind and
count as the copies in and out of a reduce-scatter. Pricing FSDP2's reduce annotations away as
well said 12.8 % on a host-bound FSDP2 pair whose fix measured no faster (docs/findings.md).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import PYTHON
from aiprof.analysis.ranks import rank_collectives
from aiprof.diagnosis.causes.common import host_collective_bytes, inside_intervals
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import COLL_END, COLL_START
from aiprof.diagnosis.model import EXPOSED_COMM, WAITING_RANK, Cause, Claim, Place
from aiprof.diagnosis.replay import Edit
from aiprof.trace.classify import FSDP_ANNOTATIONS, collective_type

CODE = "GRAD_ACCUM_ALLREDUCE"
_BACKWARD = "<built-in method run_backward"
#: the collectives that reduce gradients (an all-gather only moves parameters)
REDUCTIONS = frozenset({"AllReduce", "ReduceScatter"})
_MIB = float(1 << 20)


def _passes(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The window's backward passes: (start, end, whether each is not its step's last) in time
    order, and the passes per step (median over steps with any; 0 without Python stacks)."""
    got = f.extra.get("_backward_passes")
    if got is None:
        got = f.extra["_backward_passes"] = _find_passes(f)
    return got


def _find_passes(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    bw = f.node_mask(lambda s: s.startswith(_BACKWARD), (PYTHON,))
    if not bw.any():
        z = np.zeros(0, np.int64)
        return z, z, z.astype(bool), 0
    order = np.argsort(f.tree.start[bw], kind="stable")
    starts, ends = f.tree.start[bw][order], f.tree.end[bw][order]
    step = f.steps.index_of(starts)
    not_last = np.zeros(len(starts), dtype=bool)
    for k in range(len(starts) - 1):
        not_last[k] = step[k] >= 0 and step[k + 1] == step[k]
    counts = np.bincount(step[step >= 0], minlength=len(f.steps)) if (step >= 0).any() else np.zeros(0, np.int64)
    per_step = int(np.median(counts[counts > 0])) if (counts > 0).any() else 0
    return starts, ends, not_last, per_step


def _reduction_ops(f: RankFacts) -> tuple[np.ndarray, str]:
    """GPU ops that are gradient reductions, and their kind (the most frequent one)."""
    g, k = f.graph, f.rt.kernels
    out = np.zeros(g.n_ops, dtype=bool)
    if not g.n_ops or not len(k):
        return out, ""
    names = k.strings("name")
    kind_of = np.array([collective_type(s) for s in names.labels] + [""], dtype=object)
    kern = np.nonzero(g.o_table == 0)[0]
    kinds = kind_of[names.codes[g.o_row[kern]]]
    red = np.isin(kinds, list(REDUCTIONS))
    out[kern[red]] = True
    return out, _most_frequent(kinds[red])


def _most_frequent(kinds: np.ndarray) -> str:
    """The most frequent of the collective types (the first alphabetically on a tie; "" for none)."""
    if not len(kinds):
        return ""
    labels, counts = np.unique(kinds.astype(str), return_counts=True)
    return str(labels[np.argmax(counts)])


def _host_side(f: RankFacts) -> tuple[np.ndarray, np.ndarray]:
    """The graph's host-side collectives (a host backend such as gloo): their COLL_START actions
    and types (from the rank's collective records; "" where none starts there)."""
    g = f.graph
    at = np.nonzero(g.a_kind == COLL_START)[0] if g.a_coll is not None else np.zeros(0, np.int64)
    if not len(at):
        return at, np.zeros(0, object)
    rc = rank_collectives(f.rt)
    kind_at = {int(t): str(s).split(":", 1)[0] for t, s in zip(rc.start.tolist(), rc.sig.tolist())}
    return at, np.array([kind_at.get(int(t), "") for t in g.a_ts[at].tolist()], dtype=object)


def _host_reductions(f: RankFacts, in_pass: tuple) -> tuple[list[int], str, int]:
    """Ids of the host-side reductions that start inside the intervals ``in_pass``, their type
    (the most frequent), and how many host-side reductions the window holds."""
    at, kinds = _host_side(f)
    red = np.isin(kinds, list(REDUCTIONS))
    if not red.any():
        return [], "", 0
    g = f.graph
    inside = inside_intervals(g.a_ts[at], np.full(len(at), -1), in_pass) & red
    return [int(c) for c in g.a_coll[at[inside]].tolist()], _most_frequent(kinds[red]), int(red.sum())


def _framework(f: RankFacts) -> str:
    """"fsdp2", "fsdp1" or "" from the library's own host annotations."""
    an = f.rt.annotations
    if not len(an):
        return ""
    labels = an.strings("name").labels
    if any(s.startswith(FSDP_ANNOTATIONS[0]) for s in labels):
        return "fsdp2"
    if any(s.startswith(FSDP_ANNOTATIONS[1]) for s in labels):
        return "fsdp1"
    return ""


def skippable_edit(f: RankFacts) -> tuple[Edit | None, dict]:
    """The fix on one rank (None when no reduction runs in a pass that is not its step's last),
    and what it found: passes per step, reductions skipped and in all per step, their kind, the
    framework, the unsharded gradient bytes FSDP would keep between micro-batches."""
    got = f.extra.get("_grad_accum_edit")
    if got is None:
        got = f.extra["_grad_accum_edit"] = _skippable_edit(f)
    return got


def _skippable_edit(f: RankFacts) -> tuple[Edit | None, dict]:
    starts, ends, not_last, per_step = _passes(f)
    ts, end = starts[not_last], ends[not_last]
    if per_step < 2 or not len(ts):
        return None, {}
    g = f.graph
    red, kind = _reduction_ops(f)
    in_pass = (ts, end, np.full(len(ts), -1))
    launched = g.a_ts[g.o_action] if g.n_ops else np.zeros(0, np.int64)
    skip = red & inside_intervals(launched, np.full(len(launched), -1), in_pass)
    host_ids, host_kind, host_total = _host_reductions(f, in_pass)
    if not skip.any() and not host_ids:
        return None, {}
    fw = _framework(f)
    e = f.edit(CODE)
    e.drop_op |= skip
    if g.a_coll is not None:
        gone = set(host_ids)
        if g.o_coll is not None:
            gone |= set(np.unique(g.o_coll[skip & (g.o_coll >= 0)]).tolist())
        e.no_wait |= (g.a_kind == COLL_END) & np.isin(g.a_coll, list(gone))
    kind = kind or host_kind
    n_skip = int(skip.sum()) + len(host_ids)
    n_red = int(red.sum()) + host_total
    steps = max(len(f.steps), 1)
    found = {"passes": per_step, "skipped": n_skip / steps, "reductions": n_red / steps,
             "kind": kind, "framework": fw, "unsharded_bytes": _last_pass_reduce_scatter_bytes(f) if fw else 0.0}
    return e, found


def _last_pass_reduce_scatter_bytes(f: RankFacts) -> float:
    """Bytes per step reduce-scattered in the steps' last backward passes (the collectives' host
    records): the unsharded gradients FSDP keeps from one micro-batch to the next with the fix."""
    starts, ends, not_last, _ = _passes(f)
    return host_collective_bytes(f, "ReduceScatter", "in_nelems", (starts[~not_last], ends[~not_last], None),
                                 any_thread=True)


def _remedy(fw: str, unsharded: float) -> str:
    keep = (f" FSDP then keeps each unit's unsharded gradients between micro-batches: {unsharded / _MIB:.0f} MiB "
            "per rank, this trace's reduce-scatter inputs." if unsharded else "")
    if fw == "fsdp2":
        return ("Call model.set_requires_gradient_sync(False) before every micro-batch but the last and "
                "model.set_requires_gradient_sync(True) before the last, so FSDP reduce-scatters once per "
                "optimizer step." + keep)
    if fw == "fsdp1":
        return ("Run every micro-batch but the last (forward and backward) inside `with model.no_sync():`, so "
                "FSDP reduce-scatters once per optimizer step." + keep)
    return ("Wrap every micro-batch but the last in `with model.no_sync():` (forward and backward), so DDP "
            "all-reduces once per optimizer step.")


def detect_job(facts: list[RankFacts], pricer) -> list[Cause]:
    """One cause for the job when every rank reduces gradients after more than one backward pass."""
    edits, found = {}, {}
    for f in facts:
        e, what = skippable_edit(f)
        if e is None:
            return []
        edits[f.rank], found[f.rank] = e, what
    f0 = facts[0]
    w = found[f0.rank]
    fsdp = w["framework"] in ("fsdp1", "fsdp2")
    verb = {"ReduceScatter": "reduce-scatters", "AllReduce": "all-reduces"}.get(w["kind"], "reduces")
    who = "FSDP" if fsdp else "DDP"
    claims = [Claim(EXPOSED_COMM, f.rank, float(sum(b.communication_us for b in f.breakdown))) for f in facts]
    claims += [Claim(WAITING_RANK, f.rank, 0.0) for f in facts]
    c = Cause(
        code=CODE, rank=None,
        title=(f"gradient accumulation {verb} the gradients after every micro-batch: {w['passes']} backward passes "
               f"per step, {w['skipped']:.0f} of {w['reductions']:.0f} {w['kind'] or 'reduction'}s per step are "
               "not needed"),
        mechanism=(f"{who} reduces the gradients at the end of every backward pass ({verb} them); with gradient "
                   "accumulation only the last micro-batch's reduction is needed, the others move the whole "
                   "gradient for a sum the last one makes anyway."),
        remedy=_remedy(w["framework"], w["unsharded_bytes"]),
        place=Place("collective", f"{who} {w['kind'] or 'reduction'} (every micro-batch)", "", [], []),
        evidence={"backward_passes_per_step": w["passes"], "skippable_collectives_per_step": w["skipped"],
                  "reductions_per_step": w["reductions"], "collective": w["kind"], "framework": w["framework"],
                  "unsharded_gradient_bytes": w["unsharded_bytes"]},
        edit=edits[f0.rank], claims=claims)
    others = {r: e for r, e in edits.items() if r != f0.rank}
    pricer.price(f0, c, None, others)
    return [c]


def skippable(f: RankFacts) -> bool:
    """Whether the rank reduces gradients in a backward pass that is not its step's last."""
    return skippable_edit(f)[0] is not None


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer)


DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer"), detect=detect, every_rank=skippable)
