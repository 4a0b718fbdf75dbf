"""DATALOADER_STARVED: the training thread waits for its input.

Mechanism: with ``DataLoader(num_workers=0)`` every batch is decoded, augmented and collated
on the thread that drives the GPU, between two steps, while the GPU has nothing queued. With
workers, the thread still waits when the workers produce batches slower than the GPU consumes
them. A ``get_batch``-like function that does I/O or sleeps is the same mechanism.

Evidence: GPU-idle time while the training thread is inside data loading (DataLoader
iteration, ``__getitem__``, ``get_batch``-like functions: analysis.loading, the one definition,
whose per-step figure is the steps table's "data loading"; a stall is read from that figure).
Fix priced: the loading leaves the
training thread (workers prefetch while the GPU computes), but a step cannot be shorter than
the loading work divided among the workers suggested.
"""
from __future__ import annotations

import math

import numpy as np

from aiprof.analysis.loading import is_data_loading
from aiprof.diagnosis.causes.common import (
    biggest_node,
    idle_claim,
    ms,
    offload_edit,
    outermost,
    site_and_stack,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "DATALOADER_STARVED"
# Workers suggested at most (a common core budget per GPU on training hosts).
MAX_SUGGESTED_WORKERS = 8
# A stall: a step whose loading takes this many times the median step's (with at least this many
# steps to tell a typical step from an atypical one).
STALL_RATIO = 3.0
STALL_MIN_STEPS = 3
# ...and at least this much longer than the median step's loading: a few hundred µs of jitter on
# a loaded host is no stall (the same floor as a slow step's, symptoms.SLOW_STEP_MIN_US).
STALL_MIN_NS = 5_000_000
_SINGLE = ("_SingleProcessDataLoaderIter", "_utils/fetch.py")
_MULTI = ("_MultiProcessingDataLoaderIter", "dataloader.py(1452): _get_data", "_try_get_data")


def detect(f: RankFacts) -> list[Cause]:
    # data loading (analysis.loading): the training thread's DataLoader frames and get_batch-like functions
    loading = f.node_mask(is_data_loading) & (f.tree.tid == f.tree.main_tid) if len(f.tree) else np.zeros(0, bool)
    if not loading.any():
        return []
    roots = outermost(f, loading)
    region = f.under(roots)
    claims = idle_claim(f, region, f.gaps.loading if len(f.gaps.start) else None) if f.has_gpu else []
    if f.has_gpu and not claims:
        return []
    names = {f.tree.labels[c] for c in f.tree.code[region]}
    multi = any(any(w in s for w in _MULTI) for s in names)
    single = not multi and any(any(w in s for w in _SINGLE) for s in names)
    e, work = offload_edit(f, roots, CODE)
    base_other = max(f.step_ns - work, 1.0)
    workers = min(MAX_SUGGESTED_WORKERS, max(2, math.ceil(work / base_other) + 1))
    e.min_step_ns = work / workers
    # a stall: the loading concentrated in a few steps (a slow read, a sleep, a cache miss); per step,
    # the breakdown's data loading (ns): the figure the steps table shows
    per_step = np.array([b.dataloader_us * 1e3 for b in f.breakdown]) if len(f.breakdown) == len(f.steps) \
        else f.union_of_nodes(roots).covered(f.steps.start, f.steps.end).astype(float)
    med = float(np.median(per_step)) if len(per_step) else 0.0
    stall = [int(n) for n, v in zip(f.steps.number, per_step)
             if v >= STALL_RATIO * max(med, 1.0) and v - med >= STALL_MIN_NS] if len(per_step) >= STALL_MIN_STEPS else []
    node = biggest_node(f, roots)
    site, stack = site_and_stack(f, node)
    deepest = np.nonzero(region & (f.tree.depth == f.tree.depth[region].max()))[0] if region.any() else []
    inner = [s for s in f.tree.stack(int(deepest[0])) if s not in stack][-1:] if len(deepest) else []
    fn = f.tree.labels[f.tree.code[node]]
    per = max(len(f.steps), 1)
    idle = claims[0].us * 1e3 if claims else float(per_step.sum())
    sleeps = sorted(s for s in names if "sleep" in s)
    if multi:
        remedy = (f"The DataLoader's workers are too slow for the GPU: raise num_workers (to about {workers}), "
                  "keep persistent_workers=True and pin_memory=True, and make __getitem__ cheaper.")
    elif single:
        remedy = (f"Load batches in worker processes: DataLoader(..., num_workers={workers}, pin_memory=True, "
                  "persistent_workers=True, prefetch_factor=2) and copy with .to(device, non_blocking=True).")
    elif sleeps:
        remedy = (f"{fn} sleeps on the training thread ({sleeps[0]}): remove the sleep, or load the next batch in a "
                  "background worker (a DataLoader with num_workers>0, or a prefetch thread) while the step computes.")
    else:
        remedy = (f"Move {fn} off the training thread: prepare the next batch in a DataLoader worker or a prefetch "
                  "thread while the current step computes, and copy it with non_blocking=True.")
    waiter = "the GPU waits" if f.has_gpu else "the step waits"
    if stall:
        worst = max(zip(f.steps.number, per_step), key=lambda kv: kv[1])
        what = (f"in step {stall[0]}" if len(stall) == 1 else f"in {len(stall)} steps ({', '.join(map(str, stall[:6]))})")
        title = (f"{what} the training thread waits for its input in {fn}" + (f" ({sleeps[0]})" if sleeps else "")
                 + f": {ms(float(worst[1]))} in step {int(worst[0])}, against {ms(med)} in a typical step")
    else:
        title = (f"the training thread loads its input in {fn}: {ms(float(per_step.mean()) if len(per_step) else 0.0)} "
                 f"per step, {waiter} {ms(idle / per)} per step")
    return [Cause(
        code=CODE, rank=f.rank, title=title,
        mechanism=("Input is produced on the thread that drives the GPU, between steps; the GPU has nothing "
                   "queued until the batch is ready." if f.has_gpu else
                   "Input is produced on the training thread, between steps; the step cannot start until the "
                   "batch is ready."),
        remedy=remedy, place=Place("dataloader", fn, site, stack + inner, stall),
        evidence={"loading_us_per_step": float(per_step.mean()) / 1e3 if len(per_step) else 0.0,
                  "offloaded_us_per_step": work / 1e3, "gpu_idle_us": idle / 1e3, "workers_suggested": workers,
                  "num_workers_zero": single, "waiting_for_workers": multi, "stall_steps": stall,
                  "function": fn, "per_step_loading_us": {int(n): float(v) / 1e3 for n, v in zip(f.steps.number, per_step)}},
        edit=e, region=region, claims=claims)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("gaps", "has_gpu", "steps", "tree"), detect=detect,
                    acts_on=("host: data loading",))
