"""HOST_PREPROCESSING: pure-Python work on the thread that drives the GPU.

Mechanism: Python that is not torch dispatch (tokenisation, decoding, metric computation,
logging, a collection, a sleep) runs between two launches; the GPU finishes what it has and
waits.

Evidence: calls made from the user's code that run no torch op (a pure-Python subtree), while
the GPU is idle, grouped by their *leaf* (the innermost frame or builtin that holds the time,
followed down from the call while one child holds at least LEAF_SHARE of it) and the function
that called it (its file and name: a frame the profiler caught mid-call carries another line, and
is the same caller: the leaf's nearest user frame). Data loading is DATALOADER_STARVED's.

Remedy and fix follow from the leaf (issue 28, item 2): input preparation (analysis/loading.py's
one definition: tokenise, transform, collate, get_batch...) is told to run in workers ahead of
the GPU, priced as leaving the training thread with the step no shorter than the work itself;
any other leaf is named with where it is called from and, when the project knows the call
(gc.collect, time.sleep, print, logging, a file read), what to do about it; priced as the call
leaving the step. Work concentrated in one slow step is a one-off, HOST_STALL's (ONE_OFF_SHARE).
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from aiprof.analysis.hotspots import PYTHON, is_data_loading, is_input_preparation, is_library_frame
from aiprof.diagnosis.causes.common import (
    descend_to_leaf,
    idle_claim,
    leaf_display,
    ms,
    named_leaf,
    offload_edit,
    outermost,
    python_frame,
    site_and_stack,
    torch_work_below,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place
from aiprof.diagnosis.symptoms import completion_us, slow_step_mask

CODE = "HOST_PREPROCESSING"
# Calls of torch itself, the profiler, the interpreter's machinery: not the user's work.
_NOT_WORK = ("torch/", "<built-in method _record_function", "<built-in function _cuda", "aiprof/", "threading.py",
             "<frozen", "contextlib.py", "<built-in method __exit__", "<built-in method __enter__")
# A group must idle the GPU at least this share of the step to be reported separately.
MIN_IDLE_SHARE = 0.01
# Workers suggested at most (as for the DataLoader).
MAX_WORKERS = 8
# A child holding at least this share of its parent's time is where that time is (the leaf is
# followed down through such children); the share host_stall.LEAF_SHARE names a pause by.
LEAF_SHARE = 0.5
# A group whose time lies at least this share in one step is a one-off, not per-step work: a call
# made every step puts about 1/n of it in each of n steps (a third over the 3 steps a capture
# usually holds), and averaged over the steps a one-off would sink below steady causes. When that
# step is a slow step (symptoms.SLOW_STEP's rule), HOST_STALL reports it whole (issue 28, item 3).
ONE_OFF_SHARE = 0.8


def _caller_key(label: str) -> tuple[str, str]:
    """A calling frame as (file, function): its line varies when the profiler caught it mid-call."""
    return python_frame(label)


def _called_from(f: RankFacts, leaf: int) -> str:
    """The nearest user frame above the leaf: where the leaf is called from."""
    p = int(f.tree.parent[leaf])
    return f.tree.user_site(p) if p >= 0 else ""


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu or not len(f.tree):
        return []
    tree = f.tree
    py = tree.kind == PYTHON
    has_work = torch_work_below(f)
    parent = tree.parent
    user = f.node_mask(lambda s: not is_library_frame(s) and "(" in s and not s.startswith("<"), (PYTHON,))
    from_user = np.zeros(len(tree), dtype=bool)
    ok = parent >= 0
    from_user[ok] = user[parent[ok]]
    loading = f.under(f.node_mask(is_data_loading))
    not_work = f.node_mask(lambda s: s.startswith(_NOT_WORK))
    cand = py & ~has_work & from_user & ~loading & ~not_work & (tree.tid == tree.main_tid)
    cand = outermost(f, cand)
    if not cand.any():
        return []
    per = max(len(f.steps), 1)
    preparing = f.node_mask(is_input_preparation)
    # group by (leaf, calling function): the leaf names the work, its caller says where
    keys: dict[tuple, list[tuple[int, int]]] = {}
    for n in np.nonzero(cand)[0]:
        leaf = descend_to_leaf(f, int(n), LEAF_SHARE)
        keys.setdefault((tree.labels[tree.code[leaf]], _caller_key(_called_from(f, leaf))), []).append((int(n), leaf))
    slow = slow_step_mask(completion_us(f.rt, f.steps)) if len(f.steps) > 1 else np.zeros(len(f.steps), dtype=bool)
    out = []
    for (leaf_label, _), pairs in keys.items():
        nodes = [n for n, _ in pairs]
        leaves = np.array([lf for _, lf in pairs])
        mask = np.zeros(len(tree), dtype=bool)
        mask[nodes] = True
        claims = idle_claim(f, f.under(mask))
        if not claims or claims[0].us * 1e3 / per < MIN_IDLE_SHARE * f.recorded_step_ns:
            continue
        # the group's time by step (of the leaves: a frame caught mid-call starts before the window)
        st = f.steps.index_of(tree.start[leaves]) if len(f.steps) else np.full(len(leaves), -1)
        dur = (tree.end[leaves] - tree.start[leaves]).astype(np.float64)
        by_step = np.bincount(st[st >= 0], weights=dur[st >= 0], minlength=len(f.steps)) if (st >= 0).any() else None
        if by_step is not None and len(f.steps) > 1 and by_step.sum() > 0:
            k = int(np.argmax(by_step))
            if by_step[k] >= ONE_OFF_SHARE * by_step.sum() and slow[k]:
                continue  # a one-off in a slow step: HOST_STALL's, priced as that step's loss
        # the caller shown: the user frame most occurrences are called from (a frame caught
        # mid-call shows another line), and the biggest occurrence for the stack
        sites = Counter(_called_from(f, lf) for _, lf in pairs)
        big = max(pairs, key=lambda p: tree.end[p[0]] - tree.start[p[0]])
        caller = sites.most_common(1)[0][0] or tree.labels[tree.code[parent[big[0]]]]
        # input preparation: the call, its leaf, or the frames between them load or prepare input
        chain = tree.ancestors(big[1])  # the leaf up to the call
        chain = chain[:chain.index(big[0]) + 1]
        is_input = bool(preparing[chain].any() or preparing[parent[big[0]]])
        e, work = offload_edit(f, mask, CODE)
        site, stack = site_and_stack(f, big[1])
        where = caller if not is_library_frame(caller) else site
        what = leaf_display(leaf_label)
        calls = len(nodes) / per
        calls_s = f"{calls:.0f} call(s)" if calls >= 1 else f"{len(nodes)} call(s) in {per} steps"
        evidence = {"function": tree.labels[tree.code[big[0]]], "leaf": leaf_label, "caller": caller,
                    "calls": len(nodes), "work_us_per_step": work / 1e3, "gpu_idle_us": claims[0].us,
                    "by_step_us": {int(f.steps.number[i]): float(v) / 1e3 for i, v in enumerate(by_step)}
                    if by_step is not None else {}}
        if is_input:
            # workers enough to keep up with the GPU: the work per step over the rest of the step
            workers = min(MAX_WORKERS, max(1, math.ceil(work / max(f.step_ns - work, 1.0))))
            e.min_step_ns = work / workers
            evidence |= {"kind": "input preparation", "workers_suggested": workers}
            title = (f"{what} (called from {caller}) prepares input on the thread that drives the GPU: {ms(work)} "
                     f"per step in {calls_s}, the GPU idle meanwhile")
            remedy = (f"Run {what} ahead of the GPU in {'a worker' if workers == 1 else f'{workers} workers'} (a "
                      "process pool, or the DataLoader's workers; a thread only helps if the work releases the GIL) "
                      "that prepare the next items while the current one computes; the training thread should only "
                      "launch GPU work.")
        else:
            # not input: the call leaves the step (made every N steps, or not at all), priced so
            e.min_step_ns = 0.0
            known, advice = named_leaf(leaf_label)
            evidence |= {"kind": "named call" if known else "call"}
            title = (f"{ms(work)} per step in `{what}` called from {where} ({calls_s}): it runs on the training "
                     "thread while the GPU waits")
            if known:
                remedy = f"`{what}` runs on the training thread every step while the GPU waits: {advice}."
            else:
                remedy = (f"`{what}`, called from {where}, holds the training thread {ms(work)} per step while the "
                          "GPU waits: make it every N steps, or take it off the thread that drives the GPU.")
        out.append(Cause(
            code=CODE, rank=f.rank, title=title,
            mechanism=("Python work that launches no GPU work sits between two launches; the GPU drains its queue "
                       "and waits for the host to finish it."),
            remedy=remedy,
            place=Place("python", what, where, stack),
            evidence=evidence,
            edit=e, region=f.under(mask), claims=claims))
    return out


DETECTOR = Detector(CODE, Scope.RANK, reads=("has_gpu", "recorded_step_ns", "steps", "tree"), detect=detect,
                    acts_on=("host: python", "host: no traced event"))
