"""HOST_SCHEDULING: the serving engine's own Python (scheduling, batch preparation, output
bookkeeping) runs between two forwards while the GPU waits.

Mechanism: after a forward, the engine updates its requests, schedules the next batch and
builds its input tensors on the host before it launches the next forward; with nothing queued
meanwhile the GPU idles for all of it. Asynchronous scheduling prepares batch i+1 while the GPU
runs batch i, taking that work off the critical path.

Evidence: pure-Python calls (no torch op or CUDA call below them) made by library code on the
thread that drives the GPU, outside the model forward and outside idle iterations, while the
GPU is idle; grouped by the function called. The user's own pure-Python work (tokenising,
logging) is HOST_PREPROCESSING's. Fix priced: that work leaves the critical path (it overlaps
the GPU), and an iteration cannot be shorter than the work itself.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import PYTHON, is_data_loading, is_library_frame
from aiprof.diagnosis.causes import serving_common as sc
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

CODE = "HOST_SCHEDULING"
# A function must idle the GPU at least this share of the iteration to be reported.
MIN_IDLE_SHARE = 0.01
# ...and run in at least this share of the model's iterations: scheduling recurs every iteration
# (a request's one-off set-up is not the engine's per-iteration work).
MIN_ITERATION_SHARE = 0.5
# Frames that are not the engine's work: torch, the profiler, aiprof, waiting and the interpreter.
_NOT_WORK = ("torch/", "aiprof/", "threading.py", "<frozen", "contextlib.py", "queue.py", "<built-in method wait",
             "<built-in method acquire", "<built-in function sleep", "<built-in method __exit__",
             "<built-in method __enter__", "<built-in method _record_function")


def remedy_for(engine: str) -> str:
    if engine == sc.CB:
        return ("Overlap scheduling with the forward: ContinuousBatchingConfig(use_async_batching=True) prepares the "
                "next batch while the GPU runs the current one (double-buffered inputs).")
    if engine == sc.VLLM:
        return "Turn on asynchronous scheduling (--async-scheduling / async_scheduling=True) so the next step is planned during the current one."
    return ("Prepare the next batch while the GPU runs the current one (asynchronous scheduling: a second thread or "
            "double-buffered inputs), so the thread that launches the forward only launches.")


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu or not len(f.tree) or sc.serving(f) is None:
        return []
    tree = f.tree
    parent = tree.parent
    lib = f.node_mask(lambda s: is_library_frame(s) and "(" in s and not s.startswith(("<", "nn.Module:")), (PYTHON,))
    from_lib = np.zeros(len(tree), dtype=bool)
    ok = parent >= 0
    from_lib[ok] = lib[parent[ok]]
    forward = f.under(f.node_mask(lambda s: s.startswith("nn.Module:"), (PYTHON,)))
    busy_steps = ~sc.step_mask(f, ("idle",))
    cand = ((tree.kind == PYTHON) & ~torch_work_below(f) & from_lib & ~forward & (tree.tid == tree.main_tid)
            & ~f.under(f.node_mask(is_data_loading)) & ~f.node_mask(lambda s: s.startswith(_NOT_WORK))
            & sc.nodes_in(f, busy_steps))
    cand = outermost(f, cand)
    if not cand.any():
        return []
    per = max(int(busy_steps.sum()), 1)
    groups: dict[str, list[int]] = {}
    for n in np.nonzero(cand)[0]:
        groups.setdefault(tree.labels[tree.code[n]], []).append(int(n))
    eng = sc.engine(f)
    out = []
    for callee, nodes in groups.items():
        if len(set(f.steps.index_of(tree.start[nodes]).tolist())) < MIN_ITERATION_SHARE * per:
            continue
        mask = np.zeros(len(tree), dtype=bool)
        mask[nodes] = True
        region = f.under(mask)
        claims = idle_claim(f, region)
        if not claims or claims[0].us * 1e3 / per < MIN_IDLE_SHARE * f.recorded_step_ns:
            continue
        e, work = offload_edit(f, mask, CODE, workers=1)
        caller = tree.labels[tree.code[parent[nodes[0]]]] if parent[nodes[0]] >= 0 else ""
        _, stack = site_and_stack(f, nodes[0])
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"the engine's {callee} runs between forwards on the thread that drives the GPU: "
                   f"{ms(work)} per iteration in {len(nodes) / per:.1f} call(s), the GPU idle meanwhile"),
            mechanism=("The engine schedules the next batch and updates its requests on the host between two "
                       "forwards; nothing is queued on the GPU meanwhile."),
            remedy=remedy_for(eng), place=Place("python", callee, caller, stack),
            evidence={"function": callee, "caller": caller, "calls": len(nodes), "work_us_per_iteration": work / 1e3,
                      "gpu_idle_us": claims[0].us, "engine": eng},
            edit=e, region=region, claims=claims))
    return out


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "has_gpu", "recorded_step_ns", "steps", "tree"), detect=detect)
