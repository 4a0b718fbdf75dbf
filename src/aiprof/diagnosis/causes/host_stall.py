"""HOST_STALL: the thread that drives the GPU pauses once, in one step, and the GPU runs dry.

Mechanism: the host thread stops issuing work for one long stretch (a sleep, a blocking read, a
lock, a garbage collection, a checkpoint written once); the GPU finishes what was queued and
waits. A one-off costs its whole length in the step it happens in, so it is that step's loss:
averaged over the steps it would look like a small cost of every step and sink below the
steady ones (issue 28, item 3).

Evidence: a slow step (symptoms.SLOW_STEP's rule on completion times) whose longest host gap
(no CUDA call on any host thread) exceeds the typical step's longest gap by at least half the
step's extra time, with the GPU idle for most of that excess, outside the host regions an
earlier cause owns (a get_batch that sleeps is DATALOADER_STARVED's). Its place: the step, the
thread, the ops before and after the gap and, with Python stacks, the innermost frame that held
the time; without stacks the report says `--what python` would name the code.

Fix priced: the excess of that gap removed from the host lane (the typical gap stays); replayed,
so only what the GPU waited for counts. The saving is that step's, divided over the replayed
steps like every saving (so ranked by its total).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP, PYTHON
from aiprof.analysis.intervals import union
from aiprof.diagnosis.causes.common import idle_claim, leaf_display, ms, named_leaf, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place
from aiprof.diagnosis.symptoms import completion_us, slow_step_mask

CODE = "HOST_STALL"
# The pause explains the slow step when it is at least this share of the step's extra time (the
# rule by which a cause explains a SLOW_STEP symptom, engine.SLOW_STEP_EXPLAINED_SHARE).
EXPLAINS_SHARE = 0.5
# The GPU must be idle for at least this share of the pause's excess: a pause while the GPU still
# works through a backlog costs nothing (the host was ahead).
MIN_GPU_IDLE_SHARE = 0.5
# A pause mostly inside host regions an earlier cause owns is that cause's (above this share).
MAX_OWNED_SHARE = 0.5
# A frame (or op) names the pause when it covers at least this share of it.
LEAF_SHARE = 0.5
# One cause per stalled step, the largest this many: more slow steps than SLOW_STEP lists one by
# one (symptoms.SLOW_STEP_MAX_SEPARATE) are a recurring pattern, not a one-off.
MAX_STALLS = 3


def _covered(s: np.ndarray, e: np.ndarray, lo: float, hi: float) -> float:
    """Time of [lo, hi] covered by the intervals (s, e)."""
    if not len(s) or hi <= lo:
        return 0.0
    return float(union(np.clip(s, lo, hi), np.clip(e, lo, hi)).covered(np.array([lo]), np.array([hi]))[0])


def _longest_uncovered(s: np.ndarray, e: np.ndarray, lo: float, hi: float) -> tuple[float, float]:
    """The longest part of [lo, hi] outside the intervals (s, e)."""
    m = (e > lo) & (s < hi)
    if not m.any():
        return lo, hi
    u = union(np.clip(s[m], lo, hi), np.clip(e[m], lo, hi))
    cuts = np.concatenate([[lo], u.end]), np.concatenate([u.start, [hi]])
    k = int(np.argmax(cuts[1] - cuts[0]))
    return float(cuts[0][k]), float(cuts[1][k])


def _outermost_op(f: RankFacts, node: int) -> int:
    """The outermost op holding ``node`` (the op the user's code called)."""
    top = node
    for n in f.tree.ancestors(node):
        if f.tree.kind[n] == OP:
            top = n
    return top


def _stalls(f: RankFacts) -> list[tuple[int, int, float, float, float]]:
    """(window step index, action, pause excess ns, step ns, median step ns) of each stalled step."""
    g = f.graph
    if not g.n_actions or not len(f.steps):
        return []
    in_window = np.isin(f.steps.number, g.step_number)
    d = completion_us(f.rt, f.steps)[in_window] * 1e3
    slow = slow_step_mask(completion_us(f.rt, f.steps))[in_window]
    if not slow.any() or len(d) != len(g.step_number):
        return []
    med = float(np.median(d))
    prev_end = np.concatenate([[g.lo], np.maximum.accumulate(g.a_end)[:-1]])
    raw = np.maximum(g.a_ts - prev_end, 0).astype(np.float64)
    step_of = np.cumsum(g.a_kind == 3) - 1  # graph.STEP markers open each step
    biggest = np.full(len(d), -1, np.int64)
    for k in range(len(d)):
        idx = np.nonzero((step_of == k) & (g.a_row >= 0))[0]
        if len(idx):
            biggest[k] = int(idx[np.argmax(raw[idx])])
    typical_gaps = [raw[biggest[k]] for k in range(len(d)) if not slow[k] and biggest[k] >= 0]
    typical = float(np.median(typical_gaps)) if typical_gaps else 0.0
    out = []
    for k in np.nonzero(slow)[0]:
        i = int(biggest[k])
        if i < 0:
            continue
        excess = raw[i] - typical
        if excess < EXPLAINS_SHARE * (d[k] - med):
            continue
        out.append((int(k), i, float(excess), float(d[k]), med))
    return sorted(out, key=lambda t: -t[2])[:MAX_STALLS]


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    tree = f.tree
    owned = f.extra.get("owned_nodes")
    out = []
    prev_end = np.concatenate([[g.lo], np.maximum.accumulate(g.a_end)[:-1]])
    for k, i, excess, step_ns, med in _stalls(f):
        t0, t1 = float(prev_end[i]), float(g.a_ts[i])
        if owned is not None and len(owned) == len(tree) and owned.any():
            if _covered(tree.start[owned], tree.end[owned], t0, t1) > MAX_OWNED_SHARE * (t1 - t0):
                continue
        gp = f.gaps
        idle_mask = (gp.end > t0) & (gp.start < t1) if len(gp.start) else np.zeros(0, dtype=bool)
        if f.has_gpu:
            idle = _covered(gp.start[idle_mask], gp.end[idle_mask], t0, t1) if idle_mask.any() else 0.0
            if idle < MIN_GPU_IDLE_SHARE * excess:
                continue
        node_i = int(f.action_nodes()[i])
        tid = int(tree.tid[node_i]) if node_i >= 0 else int(tree.main_tid)
        on = tree.tid == tid
        ops = on & (tree.kind == OP)
        # the stretch with no op running on that thread, and the ops on either side of it
        s0, s1 = _longest_uncovered(tree.start[ops], tree.end[ops], t0, t1)
        if s1 - s0 < LEAF_SHARE * (t1 - t0):
            s0, s1 = t0, t1  # the time is inside an op: the frames below name it
        before = np.nonzero(ops & (tree.end <= s0 + 1))[0]
        after = np.nonzero(ops & (tree.start >= s1 - 1))[0]
        op_before = tree.name(_outermost_op(f, int(before[np.argmax(tree.end[before])]))) if len(before) else ""
        op_after = tree.name(_outermost_op(f, int(after[np.argmin(tree.start[after])]))) if len(after) else ""
        # the innermost event (a Python frame, a builtin, an op) that held most of the stretch
        cover = np.minimum(tree.end, s1) - np.maximum(tree.start, s0)
        holders = np.nonzero(on & (cover >= LEAF_SHARE * (s1 - s0)))[0]
        leaf = int(holders[np.argmax(tree.depth[holders])]) if len(holders) else -1
        site, stack = site_and_stack(f, leaf)
        leaf_name = tree.name(leaf) if leaf >= 0 else ""
        has_python = bool((tree.kind == PYTHON).any())
        number = int(g.step_number[k])
        thread = "the main thread" if tid == tree.main_tid else f"thread {tid}"
        between = (f"between {op_before or 'the step start'} and {op_after or 'the step end'}")
        known, advice = named_leaf(leaf_name)
        shown = leaf_display(leaf_name) if leaf >= 0 else ""
        if leaf >= 0:
            where = f"in `{shown}`" + (f" called from {site}" if site and site != leaf_name else "")
        else:
            where = between
        e = f.edit(CODE)
        e.gap_remove[i] = max(float(g.gap[i]), 0.0) * min(excess / max(float(t1 - t0), 1.0), 1.0)
        region = on & (tree.start >= t0) & (tree.end <= t1)
        if known:
            remedy = (f"`{shown}`" + (f" at {site}" if site else "") + f" held {thread} for {ms(excess)} in step "
                      f"{number} while the GPU had nothing queued: {advice}.")
        elif leaf >= 0 and tree.kind[leaf] != OP:
            known = f"{leaf_name}" + (f" at {site}" if site and site != leaf_name else "")
            remedy = (f"{known} held {thread} for {ms(excess)} in step {number} while the GPU had nothing queued: "
                      "find what it waits for there (a sleep, a file or network read, a lock, a collection, a save) "
                      "and take it out of the step or off the thread that drives the GPU.")
        elif has_python:
            remedy = (f"{thread} paused {between}, in code the trace holds no event for: take the pause out of the "
                      "step or off the thread that drives the GPU.")
        else:
            remedy = (f"No Python stack was recorded, so the code is not known: the pause lies {between}. Capture "
                      "again with Python stacks (`aiprof run --what python`, or torch.profiler with_stack=True) to "
                      "name the function; then take the pause out of the step or off the thread that drives the GPU.")
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"{ms(excess)} in step {number} {where}: {thread} paused with nothing queued on the GPU "
                   f"(the step took {ms(step_ns)} against a median {ms(med)})"),
            mechanism=("The thread that drives the GPU stopped issuing work for one long stretch of this step; the "
                       "GPU finished what was queued and waited. A one-off pause costs its whole length in the step it "
                       "happens in."),
            remedy=remedy,
            place=Place("step", leaf_name or between, site, stack, [number]),
            evidence={"step": number, "pause_us": excess / 1e3, "gap_us": (t1 - t0) / 1e3,
                      "step_us": step_ns / 1e3, "median_step_us": med / 1e3, "thread": tid,
                      "main_thread": tid == tree.main_tid, "op_before": op_before, "op_after": op_after,
                      "leaf": leaf_name, "python_stacks": has_python,
                      # a one-off is listed whatever its share of the averaged step: it passed the
                      # slow-step rule (>= 5 ms and 1.3x the median), so it is no noise
                      "always_reported": True},
            edit=e, region=region, claims=idle_claim(f, np.zeros(len(tree), dtype=bool), idle_mask)))
    return out


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "gaps", "has_gpu", "rt", "steps", "tree"), detect=detect,
                    acts_on=("host: python", "host: no traced event"))
