"""ZEROED_GRADS: gradients zeroed every step instead of set to None.

Mechanism: ``optimizer.zero_grad(set_to_none=False)`` (or ``model.zero_grad(set_to_none=False)``)
writes zeros into every gradient buffer each step (``aten::zero_`` per parameter, or one
``aten::_foreach_zero_`` per group: a full pass over the gradients' memory), and the next
backward then finds a gradient in place and adds into it: ``AccumulateGrad`` runs ``aten::add_``
(read both, write one) where, with no gradient, it takes the backward's result as the gradient
(``aten::detach``: no pass over memory). With ``set_to_none=True``, PyTorch's default since 2.0,
neither runs. PyTorch's Performance Tuning Guide: "use parameter.grad = None instead of
model.zero_grad() or optimizer.zero_grad()".

Evidence: zeroing ops (``aten::zero_``, ``aten::_foreach_zero_``) inside an optimizer's
``Optimizer.zero_grad#`` range or a ``zero_grad`` frame of torch's optimizer or module, and
``aten::add_`` as the direct child of ``torch::autograd::AccumulateGrad`` after them, both in at
least half of the steps. Fix priced: the zeroing ops removed, and the adds of the backward pass
that follows each zero_grad call (from its first add to the training thread's next op outside a
backward); the adds of later passes (gradient accumulation) add into that pass's gradients either
way and stay, and so do adds no zero_grad precedes (another optimizer's grads set to None). A hand-written
``p.grad.zero_()`` loop has no range or torch frame to tell its zeros from others': not detected.

GPU traces only. The saving assumes the new gradients' memory is reused, as CUDA's caching
allocator does. On the CPU, glibc maps large blocks fresh: on this cause's CPU pair
(bench/diagnosis/cpu_zero_grad.py, 1024-wide layers, 4 MB gradients) ``set_to_none=True`` made
each step *slower*, 23.3 against 18.2 ms, with 5.3x the page faults (1,140,380 against 216,870
in 200 steps); with glibc told to keep freed blocks (``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` at 1 GiB) it was faster, 15.2 against 17.1 ms. A CPU trace does not
show which allocator behaviour the fix would meet, so it says nothing there.

Experimental (``AIPROF_EXPERIMENTAL_CAUSES=ZEROED_GRADS``). Its GPU pair (v3_job.py's ``zerograd``
case, tests/data/v3b) measured 2.1 and 2.2 % in two runs on an H100; it predicts 1.4 %, just
outside 1.5x of that, for a saving near the noise of one step.
"""
from __future__ import annotations

import re

import numpy as np

from aiprof.analysis.hotspots import ANNOTATION, OP, PYTHON
from aiprof.diagnosis.causes.common import (biggest_node, idle_claim, ms, outermost, removal_edit, site_and_stack,
                                            steps_with)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "ZEROED_GRADS"
_ZERO_OPS = ("aten::zero_", "aten::_foreach_zero_")
_ZERO_GRAD_RANGE = "Optimizer.zero_grad#"  # torch.optim.Optimizer.zero_grad's record_function
_ZERO_GRAD_FRAME = re.compile(r"torch/(optim/optimizer|nn/modules/module)\.py\(\d+\): zero_grad$")
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_ADD = "aten::add_"
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
#: Both in at least this share of the steps: the loop's own zeroing, not a one-off reset.
RECURRING_SHARE = 0.5


def _zero_grad_calls(f: RankFacts) -> np.ndarray:
    """The outermost ``zero_grad`` ranges and frames (of torch's optimizer or module)."""
    where = f.node_mask(lambda s: s.startswith(_ZERO_GRAD_RANGE), (ANNOTATION, OP))
    where = where | f.node_mask(lambda s: bool(_ZERO_GRAD_FRAME.search(s)), (PYTHON,))
    return outermost(f, where)


def _zeroing(f: RankFacts, calls: np.ndarray | None = None) -> np.ndarray:
    """The outermost zeroing ops inside a ``zero_grad`` call."""
    calls = _zero_grad_calls(f) if calls is None else calls
    if not calls.any():
        return np.zeros(len(f.tree), dtype=bool)
    zeros = f.under(calls) & f.node_mask(lambda s: s in _ZERO_OPS, (OP,))
    return outermost(f, zeros)


def _accumulating_adds(f: RankFacts) -> np.ndarray:
    """``aten::add_`` ops that are the direct child of an ``AccumulateGrad`` node."""
    t = f.tree
    adds = f.node_mask(lambda s: s == _ADD, (OP,)).copy()  # node_mask's arrays are cached: not ours to edit
    acc = f.node_mask(lambda s: s == _ACCUMULATE, (OP, ANNOTATION))
    idx = np.nonzero(adds)[0]
    par = t.parent[idx]
    adds[idx[(par < 0) | ~acc[np.maximum(par, 0)]]] = False
    return adds


def _first_pass(f: RankFacts, adds: np.ndarray, zeroing: np.ndarray, calls: np.ndarray | None = None) -> np.ndarray:
    """The adds the fix removes: after each zero_grad call that zeroed something, those of the
    backward pass that follows it, from its first add to the first op of the training thread
    (the zeroing ops' thread) that starts after that add outside a backward (the next forward,
    under gradient accumulation, or the optimizer)."""
    t = f.tree
    out = np.zeros(len(t), dtype=bool)
    calls = _zero_grad_calls(f) if calls is None else calls
    zeroed = {a for n in np.nonzero(zeroing)[0] for a in t.ancestors(n) if calls[a]}  # the calls that zeroed
    ends = np.sort(t.end[sorted(zeroed)]) if zeroed else np.zeros(0, np.int64)
    add_idx = np.nonzero(adds)[0]
    add_idx = add_idx[np.argsort(t.start[add_idx], kind="stable")]
    add_start = t.start[add_idx]
    backward = f.under(f.node_mask(lambda s: s.startswith(_BACKWARD_NODE), (OP, ANNOTATION)))
    threads = np.unique(t.tid[zeroing])
    others = outermost(f, (t.kind == OP) & ~backward & np.isin(t.tid, threads))
    other_start = np.sort(t.start[others])
    for i, end in enumerate(ends):
        nxt = ends[i + 1] if i + 1 < len(ends) else np.iinfo(np.int64).max
        k = np.searchsorted(add_start, end, side="right")  # the first add after this call
        if k >= len(add_start) or add_start[k] >= nxt:
            continue  # no add before the next zero_grad: nothing accumulated into these zeros
        j = np.searchsorted(other_start, add_start[k], side="right")
        cut = min(other_start[j] if j < len(other_start) else np.iinfo(np.int64).max, nxt)
        out[add_idx[(add_start >= add_start[k]) & (add_start < cut)]] = True
    return out


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu:
        return []  # the saving depends on the CPU allocator reusing memory: not in a trace (above)
    calls = _zero_grad_calls(f)
    zeroing = _zeroing(f, calls)
    if not zeroing.any():
        return []
    adds = _accumulating_adds(f)
    if not adds.any():
        return []
    need = max(1, RECURRING_SHARE * len(f.steps))
    if len(steps_with(f, zeroing)) < need or len(steps_with(f, adds)) < need:
        return []
    first = _first_pass(f, adds, zeroing, calls)
    roots = zeroing | first
    region = f.under(roots)
    e, _ = removal_edit(f, roots, CODE)  # on a GPU: the memsets' and adds' launches too
    t = f.tree
    per = max(len(f.steps), 1)
    zero_ns = float((t.end[zeroing] - t.start[zeroing]).sum())
    add_ns = float((t.end[first] - t.start[first]).sum())
    n_adds, n_all_adds = int(first.sum()), int(adds.sum())
    site, stack = site_and_stack(f, biggest_node(f, zeroing))
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"gradients are zeroed every step instead of set to None: {int(zeroing.sum()) / per:.0f} zeroing ops "
               f"({ms(zero_ns / per)} on the host) and {n_adds / per:.0f} accumulating adds in backward "
               f"({ms(add_ns / per)}) per step, each a pass over the gradients' memory"),
        mechanism=("zero_grad(set_to_none=False) writes zeros into every gradient, and backward's AccumulateGrad "
                   "then adds its result into them (aten::add_: two reads and a write of each gradient) instead "
                   "of taking the result as the gradient: two passes over the gradients' memory that set_to_none "
                   "skips."),
        remedy=("Use optimizer.zero_grad(set_to_none=True) (PyTorch's default since 2.0) or model.zero_grad() "
                "without set_to_none=False, or set p.grad = None (PyTorch Performance Tuning Guide). Code that "
                "reads p.grad between zero_grad and backward must then handle None."),
        place=Place("op", "zero_grad(set_to_none=False)", site, stack),
        evidence={"zeroing_ops": int(zeroing.sum()), "host_us_zeroing": zero_ns / 1e3,
                  "accumulating_adds": n_all_adds, "adds_removed": n_adds, "host_us_in_adds_removed": add_ns / 1e3,
                  "steps_with_zeroing": steps_with(f, zeroing)},
        edit=e, region=region, claims=idle_claim(f, region) if f.has_gpu else [])]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "steps", "tree"), detect=detect, experimental=True)
