"""SYNC_CHECKPOINT: a checkpoint saved on the training thread, step after step.

Mechanism: ``torch.save`` (or torch.distributed.checkpoint's synchronous ``save``) of the model
and optimizer state copies every GPU tensor to host memory (each copy waits for the GPU, from
pageable memory), then pickles it and writes the file, all on the thread that drives the GPU;
the GPU has nothing queued until the save returns. Its cost is the save's whole host time: the
copies, the syncs they wait for, and the write (issue 28, item 2: the write was not priced).

Evidence: save frames (torch/serialization.py ``save``, torch/distributed/checkpoint ``save`` /
``save_state_dict``; not ``async_save``) on the training thread in at least EVERY_STEP_SHARE of
the steps; their time, the tensors copied inside them. A save in one step only is a one-off
(HOST_STALL's, priced as that step's loss).

Fix priced: the save leaves the step (saved every N steps, or asynchronously): its host gaps, the
CUDA calls inside it (no longer waiting) and the copies they launch are removed. It runs before
HOST_SYNC and PAGEABLE_COPY, which leave the copies and syncs inside a save to it (no double
count: they skip host regions an earlier cause owns).
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from aiprof.analysis.hotspots import PYTHON
from aiprof.diagnosis.causes.common import idle_claim, ms, offload_edit, outermost, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "SYNC_CHECKPOINT"
# torch.save, and torch.distributed.checkpoint's synchronous saves (async_save is the remedy).
_SAVE = re.compile(r"^(?:.*/)?torch/(?:serialization\.py\(\d+\): save"
                   r"|distributed/checkpoint/state_dict_saver\.py\(\d+\): (?:save|save_state_dict|_save_state_dict))$")
# A save recurs when it is in at least this share of the captured steps (every step, or every
# other one); in fewer it is a one-off, whose cost is its step's (HOST_STALL).
EVERY_STEP_SHARE = 0.5
# A save must idle the GPU at least this share of the step to be reported (as HOST_PREPROCESSING).
MIN_IDLE_SHARE = 0.01


def is_save(name: str) -> bool:
    return bool(_SAVE.match(name))


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu or not len(f.tree) or not len(f.steps):
        return []
    tree = f.tree
    saves = outermost(f, f.node_mask(is_save, (PYTHON,)) & (tree.tid == tree.main_tid))
    if not saves.any():
        return []
    idx = np.nonzero(saves)[0]
    st = f.steps.index_of(tree.start[idx])
    per = max(len(f.steps), 1)
    steps_hit = np.unique(st[st >= 0])
    if len(steps_hit) < EVERY_STEP_SHARE * per or (per > 1 and len(steps_hit) < 2):
        return []
    region = f.under(saves)
    claims = idle_claim(f, region)
    if not claims or claims[0].us * 1e3 / per < MIN_IDLE_SHARE * f.recorded_step_ns:
        return []
    e, work = offload_edit(f, saves, CODE)
    e.min_step_ns = 0.0  # the save leaves the step: saved every N steps or asynchronously
    g = f.graph
    an = f.action_nodes()
    inside = np.zeros(g.n_actions, dtype=bool)
    ok = an >= 0
    inside[ok] = region[an[ok]]
    inside &= g.a_row >= 0
    e.cost_remove[inside] = g.cost[inside]
    e.no_wait[inside] = True
    copies = np.isin(g.o_action, np.nonzero(inside)[0])
    e.drop_op[copies] = True
    n_copies = int((copies & (g.o_table == 1)).sum()) if g.n_ops else 0
    big = int(idx[np.argmax(tree.end[idx] - tree.start[idx])])
    _, stack = site_and_stack(f, big)
    # where it is called from: the site most saves share (a frame caught mid-call shows another line)
    site = Counter(tree.user_site(int(n)) for n in idx).most_common(1)[0][0]
    what = "torch.save" if "serialization.py" in tree.name(big) else "torch.distributed.checkpoint.save"
    every = "every step" if len(steps_hit) >= per else f"in {len(steps_hit)} of {per} steps"
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{what} on the training thread {every}, called from {site or 'an unknown site'}: {ms(work)} per step "
               f"(copying {n_copies / per:.0f} tensors to the host, the syncs they wait for, pickling and the file "
               "write), the GPU idle meanwhile"),
        mechanism=("A synchronous checkpoint copies every GPU tensor to host memory (each copy waits for the GPU), "
                   "pickles the state and writes the file on the thread that drives the GPU: nothing is queued on "
                   "the GPU until the save returns."),
        remedy=(f"Save every N steps instead of {every}, or asynchronously: torch.distributed.checkpoint.async_save "
                "(state_dict, checkpoint_id=...) copies the state and writes it in the background; or copy the "
                "tensors into pinned CPU buffers allocated once (.copy_(t, non_blocking=True)) and write the file from "
                "a background thread."),
        place=Place("python", what, site, stack),
        evidence={"function": what, "calls": int(len(idx)), "steps": [int(f.steps.number[i]) for i in steps_hit],
                  "work_us_per_step": work / 1e3, "copies_per_step": n_copies / per, "gpu_idle_us": claims[0].us},
        edit=e, region=region, claims=claims)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "has_gpu", "recorded_step_ns", "steps", "tree"), detect=detect,
                    acts_on=("host: python", "host: cuda sync", "host: no traced event"))
