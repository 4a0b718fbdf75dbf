"""UNEXPLAINED: a leaf the GPU waits for that no cause claims, named and priced all the same.

Mechanism: none known. Every nanosecond of the rank's replayed critical path belongs to a leaf
(diagnosis/critical_path.py): host work in a named function, builtin or op, a CUDA call, the
launch latency. Where the GPU waits for such a leaf and no cause's fix changes it, the report
still says what it is, where it is called from and what removing it would save, ranked with the
causes (issue 28: never bury the biggest loss). The remedy is no more specific than that: a
call the project recognises (``gc.collect``, a file read, ``print``) gets its known advice;
anything else is named plainly, with no guessed mechanism.

Fix priced: the leaf's time removed from the critical path (its host work, its calls' own
cost, its launches' latency), replayed once the specific causes are fixed (it runs last and is
priced as the generic detectors are: marginally).
"""
from __future__ import annotations

import numpy as np

from aiprof.diagnosis.causes.common import leaf_display, ms, named_leaf
from aiprof.diagnosis.critical_path import (
    CALL,
    KIND_NAMES,
    LATENCY,
    UNTRACED,
    Leaf,
    claimed_by,
    rank_path,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import MIN_REPORTED_SHARE, Cause, Place

CODE = "UNEXPLAINED"
# A leaf is named when the GPU waits for it at least the report's floor share of the step: below
# it, the leaf would be a "minor" cause anyway.
MIN_SHARE = MIN_REPORTED_SHARE
# At most this many unexplained leaves per rank: the largest ones; the rest stay in the
# critical-path table of the report (baseline rows).
MAX_LEAVES = 3
# A leaf whose time lies for at least this share in one step is that step's (a one-off).
ONE_STEP_SHARE = 0.8


def _name(lf: Leaf) -> str:
    return leaf_display(lf.name)


def _remedy(lf: Leaf, where: str, amount: str) -> str:
    """What to do, from what the leaf is and no more (``amount``: "12 ms per step", "80 ms in step 3")."""
    known, advice = named_leaf(lf.name)
    if known:
        return f"`{known}`{where} holds the thread that drives the GPU for {amount}: {advice}."
    if lf.kind == KIND_NAMES[LATENCY]:
        return ("The GPU waits for each kernel's launch: fewer, larger launches would cut it (CUDA graphs, or "
                "torch.compile, which fuses small ops).")
    if lf.kind == KIND_NAMES[CALL]:
        return (f"The CUDA call `{lf.name}`{where} takes {amount} on the thread that drives the GPU; "
                "aiprof cannot tell why from this capture: make fewer of these calls there.")
    if lf.event == "op":
        return (f"The host's own time in `{lf.name}` (dispatching the op){where} takes {amount} while "
                "the GPU waits: fewer, larger ops cut it (torch.compile fuses them).")
    if lf.name == UNTRACED:
        return ("No event was recorded for this host time, so the code is not known: capture again with Python "
                "stacks (`aiprof run --what python`) to name it.")
    return (f"`{_name(lf)}`{where} takes {amount} on the thread that drives the GPU while the GPU waits; "
            "aiprof knows no mechanism for it: make it cheaper, call it less often, or move it off that thread.")


def detect(f: RankFacts) -> list[Cause]:
    found = f.extra.get("found", [])
    path, lvs = rank_path(f)
    total = max(path.total_ns, 1.0)
    n = max(len(f.graph.step_number), 1)
    out: list[Cause] = []
    for lf in lvs:
        if len(out) >= MAX_LEAVES or lf.ns < MIN_SHARE * total:
            break
        if not lf.loss or claimed_by(f, lf, found):
            continue
        e = f.edit(CODE)
        np.add.at(e.gap_remove, lf.piece_action, lf.piece_ns)
        np.add.at(e.cost_remove, lf.cost_action, lf.cost_ns)
        e.packed[lf.ops] = True
        if not (len(lf.piece_ns) or len(lf.cost_ns) or len(lf.ops)):
            continue  # a GPU delay the trace does not explain: nothing a change could remove
        inside = f" inside `{leaf_display(lf.entry)}`" if lf.entry else ""
        where = inside + (f" called from {lf.site}" if lf.site else "")
        step, in_step = max(lf.by_step_ns.items(), key=lambda kv: kv[1]) if lf.by_step_ns else (None, 0.0)
        one_step = step is not None and n > 1 and in_step >= ONE_STEP_SHARE * lf.ns
        amount = f"{ms(in_step)} in step {step}" if one_step else f"{ms(lf.ns / n)} per step"
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"{amount} on the critical path in `{_name(lf)}`{where} ({lf.kind}): the GPU waits for it, "
                   "and no cause aiprof knows explains it"),
            mechanism=("This time is on the step's critical path (the replayed step ends later by it) and the GPU has "
                       "nothing queued during it. aiprof found no known mechanism for it; it is named so that the "
                       "biggest loss is never left out (docs/findings.md, UNEXPLAINED)."),
            remedy=_remedy(lf, where, amount),
            place=Place("leaf", lf.name, lf.site, [], [int(step)] if one_step else []),
            evidence={"leaf": lf.name, "kind": lf.kind, "site": lf.site, "entry": lf.entry,
                      "critical_path_us": lf.ns / 1e3,
                      "by_step_us": {int(s): v / 1e3 for s, v in lf.by_step_ns.items()}},
            edit=e))
    return out


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "rt", "tree"), detect=detect, generic=True, last=True)
