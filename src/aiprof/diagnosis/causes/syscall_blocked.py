"""SYSCALL_BLOCKED: the training thread is blocked in a system call (I/O or a lock) during steps.

Mechanism: the thread that drives the steps sits in the kernel waiting, in ``read()`` for a
file or socket (the data is read synchronously in the loop) or in ``futex()`` for a lock another
thread holds, and during that wait nothing is queued on the GPU (or, on a CPU job, the step
makes no progress).

Evidence: the native sidecar's sampled system calls (``syscalls`` table, ``--what syscalls``):
the blocked time of the main thread within the steps, by class (io, lock), while the GPU idles.
Place: the innermost Python frame open on the main thread during the waits, and the file the
reads wait on. Fix priced: the wait leaves the training thread (reads in a prefetching worker;
the lock not held across the step), but a step cannot be shorter than the waiting spread over
the workers suggested.
"""
from __future__ import annotations

import re

import numpy as np

from aiprof.diagnosis.causes.common import biggest_node, idle_claim, ms, offload_edit, outermost, pct, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "SYSCALL_BLOCKED"
# Blocked time below this share of the step is noise of the sampling (2 ms default period).
MIN_STEP_SHARE = 0.05
# Workers assumed for the priced fix: the reads overlap the step in two prefetch workers.
PREFETCH_WORKERS = 2
CLASSES = ("io", "lock")


def detect(f: RankFacts) -> list[Cause]:
    sc = f.rt.table("syscalls")
    if not len(sc) or not len(f.steps) or not len(f.tree):
        return []
    main = f.tree.main_tid
    cls = sc.strings("cls").values()
    m = (sc["tid"] == main) & np.isin(cls, CLASSES)
    if not m.any():
        return []
    lo, hi = int(f.steps.start.min()), int(f.steps.end.max())
    st = np.clip(sc["ts"][m], lo, hi)
    en = np.clip(sc["ts"][m] + sc["dur"][m], lo, hi)
    keep = en > st
    if not keep.any():
        return []
    st, en = st[keep], en[keep]
    names = sc.strings("name").values()[m][keep]
    paths = sc.strings("path").values()[m][keep]
    kinds = cls[m][keep]
    blocked = float((en - st).sum())
    per_step = blocked / max(len(f.steps), 1)
    if per_step < MIN_STEP_SHARE * f.recorded_step_ns:
        return []
    by_kind = {k: float((en - st)[kinds == k].sum()) for k in CLASSES}
    kind = max(by_kind, key=by_kind.get)
    by_name: dict[str, float] = {}
    for n, d in zip(names.tolist(), (en - st).tolist()):
        by_name[n] = by_name.get(n, 0.0) + d
    top_call = max(by_name, key=by_name.get)
    by_path: dict[str, float] = {}
    for p, d in zip(paths.tolist(), (en - st).tolist()):
        if p:
            by_path[p] = by_path.get(p, 0.0) + d
    top_path = max(by_path, key=by_path.get) if by_path else ""
    # the Python frames the thread was in while blocked: the innermost at each wait's midpoint; the
    # place is the function holding the most blocked time (a sampled wait that spills past its call,
    # e.g. into the loop around it, must not make the whole loop the place)
    nodes = f.tree.innermost_at((st + en) // 2)
    region_roots = np.zeros(len(f.tree), dtype=bool)
    hit = nodes >= 0
    if hit.any():
        codes = f.tree.code[nodes[hit]]
        top_code = int(np.argmax(np.bincount(codes, weights=(en - st)[hit])))
        region_roots[nodes[hit][codes == top_code]] = True
    claims = []
    if region_roots.any():
        roots = outermost(f, region_roots)
        region = f.under(roots)
        claims = idle_claim(f, region) if f.has_gpu else []
        e, work = offload_edit(f, roots, CODE, workers=PREFETCH_WORKERS)
        node = biggest_node(f, roots)
        site, stack = site_and_stack(f, node)
        fn = re.sub(r" object at 0x[0-9a-fA-F]+>$", ">", f.tree.name(node)) if node >= 0 else top_call
    else:
        region, e, site, stack, fn = None, None, "", [], top_call
    share = per_step / max(f.recorded_step_ns, 1.0)
    where = f" on {top_path}" if top_path else ""
    if kind == "io":
        title = (f"the training thread is blocked in {top_call}(){where} for {ms(per_step)} per step "
                 f"({pct(share)} of the step), in {fn}")
        remedy = (f"Take the blocking {top_call}() out of the training loop: read{where} ahead in a background "
                  "thread or DataLoader workers (num_workers>0, prefetch_factor=2), or keep the data in memory / "
                  "memory-map it, so that the step never waits for the disk.")
        mech = ("The thread that drives the steps waits in the kernel for file or socket data; nothing is queued "
                "on the GPU meanwhile." if f.has_gpu else
                "The thread that runs the steps waits in the kernel for file or socket data between computations.")
    else:
        title = (f"the training thread waits on a lock ({top_call}) for {ms(per_step)} per step "
                 f"({pct(share)} of the step), in {fn}")
        remedy = ("Find the thread that holds the lock during the step (the syscall view lists every thread's "
                  "waits): shorten the critical section, or hand data over through a queue instead of a shared lock.")
        mech = "The thread that drives the steps sleeps in futex() until another thread releases a lock."
    return [Cause(
        code=CODE, rank=f.rank, title=title, mechanism=mech, remedy=remedy,
        place=Place("syscall", f"{top_call}()" + where, site, stack, []),
        evidence={"blocked_us_per_step": per_step / 1e3, "step_share": share, "class": kind,
                  "by_syscall_us": {k: v / 1e3 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
                  "top_path": top_path, "function": fn, "source": "syscalls sampled from /proc (native sidecar)"},
        edit=e, region=region, claims=claims)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("has_gpu", "recorded_step_ns", "rt", "steps", "tree"), detect=detect)
