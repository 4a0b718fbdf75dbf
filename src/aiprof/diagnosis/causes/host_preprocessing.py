"""HOST_PREPROCESSING: pure-Python work on the thread that drives the GPU.

Mechanism: Python that is not torch dispatch (tokenisation, decoding, metric computation,
logging) runs between two launches; the GPU finishes what it has and waits. Moved to a worker
(thread or process) that works ahead, it overlaps the GPU instead.

Evidence: calls made from the user's code that run no torch op (a pure-Python subtree), while
the GPU is idle, grouped by the function called and the line that called it. Data loading is
DATALOADER_STARVED's. Fix priced: that work leaves the training thread, and the step cannot be
shorter than the work itself (it is still done once per step, elsewhere).
"""
from __future__ import annotations

import math

import numpy as np

from aiprof.analysis.hotspots import PYTHON, is_data_loading, is_library_frame
from aiprof.diagnosis.causes.common import (
    idle_claim,
    ms,
    offload_edit,
    outermost,
    site_and_stack,
    torch_work_below,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "HOST_PREPROCESSING"
# Calls of torch itself, the profiler, the interpreter's machinery: not the user's work.
_NOT_WORK = ("torch/", "<built-in method _record_function", "<built-in function _cuda", "aiprof/", "threading.py",
             "<frozen", "contextlib.py", "<built-in method __exit__", "<built-in method __enter__")
# A group must idle the GPU at least this share of the step to be reported separately.
MIN_IDLE_SHARE = 0.01
# Workers suggested at most (as for the DataLoader).
MAX_WORKERS = 8


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
    # group by (callee, calling line)
    keys = {}
    for n in np.nonzero(cand)[0]:
        keys.setdefault((tree.labels[tree.code[n]], tree.labels[tree.code[parent[n]]]), []).append(n)
    out = []
    for (callee, caller), nodes in keys.items():
        mask = np.zeros(len(tree), dtype=bool)
        mask[nodes] = True
        claims = idle_claim(f, f.under(mask))
        if not claims or claims[0].us * 1e3 / per < MIN_IDLE_SHARE * f.recorded_step_ns:
            continue
        e, work = offload_edit(f, mask, CODE)
        # workers enough to keep up with the GPU: the work per step over the rest of the step
        workers = min(MAX_WORKERS, max(1, math.ceil(work / max(f.step_ns - work, 1.0))))
        e.min_step_ns = work / workers
        site, stack = site_and_stack(f, nodes[0])
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"{callee} (called from {caller}) runs on the thread that drives the GPU: {ms(work)} per step "
                   f"in {len(nodes) / per:.0f} call(s), the GPU idle meanwhile"),
            mechanism=("Python work that launches no GPU work sits between two launches; the GPU drains its queue "
                       "and waits for the host to finish it."),
            remedy=(f"Run {callee} ahead of the GPU in {'a worker' if workers == 1 else f'{workers} workers'} (a "
                    "process pool, or the DataLoader's workers; a thread only helps if the work releases the GIL) that "
                    "prepare the next items while the current one computes; the training thread should only launch "
                    "GPU work."),
            place=Place("python", callee, caller if not is_library_frame(caller) else site, stack),
            evidence={"function": callee, "caller": caller, "calls": len(nodes), "work_us_per_step": work / 1e3,
                      "workers_suggested": workers,
                      "gpu_idle_us": claims[0].us},
            edit=e, region=f.under(mask), claims=claims))
    return out


DETECTOR = Detector(CODE, Scope.RANK, reads=("has_gpu", "recorded_step_ns", "steps", "tree"), detect=detect,
                    acts_on=("host: python", "host: no traced event"))
