"""Helpers shared by the cause detectors: names, sites, and the GPU-idle time a region explains."""
from __future__ import annotations

import re

import numpy as np

from aiprof.analysis.comm import DTYPE_BYTES
from aiprof.analysis.hotspots import OP, PYTHON, RUNTIME, is_library_frame
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.leafnames import leaf_display, named_leaf  # noqa: F401 (the causes' names for leaves)
from aiprof.diagnosis.model import GPU_IDLE, Claim

NS_PER_US = 1000.0


def ms(ns: float) -> str:
    """A duration in ns as '12.3 ms' (or µs below a millisecond)."""
    return f"{ns / 1e6:.1f} ms" if abs(ns) >= 1e6 else f"{ns / 1e3:.0f} µs"


def pct(x: float) -> str:
    return f"{100.0 * x:.0f}%" if x >= 0.1 else f"{100.0 * x:.1f}%"


def biggest_node(f: RankFacts, mask: np.ndarray) -> int:
    """The longest node of the mask (-1 when empty): the representative occurrence."""
    idx = np.nonzero(mask)[0]
    if not len(idx):
        return -1
    return int(idx[np.argmax(f.tree.end[idx] - f.tree.start[idx])])


def site_and_stack(f: RankFacts, node: int) -> tuple[str, list[str]]:
    """The user's frame and the Python stack (outermost first, last 6) of a node."""
    if node < 0:
        return "", []
    return f.tree.user_site(node), f.tree.stack(node)[-6:]


def outermost(f: RankFacts, mask: np.ndarray) -> np.ndarray:
    """Nodes of the mask with no ancestor in the mask."""
    out = mask.copy()
    if not out.any():
        return out
    cur = f.tree.parent.copy()
    active = out & (cur >= 0)
    while active.any():
        idx = np.nonzero(active)[0]
        hit = mask[cur[idx]]
        out[idx[hit]] = False
        nxt = f.tree.parent[cur[idx]]
        cur[idx] = nxt
        active[idx] = ~hit & (nxt >= 0)
    return out


def idle_claim(f: RankFacts, region: np.ndarray, extra_gap_mask: np.ndarray | None = None) -> list[Claim]:
    """The GPU-idle time (recorded, µs) whose innermost host event lies in ``region`` (a node
    mask from ``f.under``), as a claim on the GPU_IDLE symptom."""
    gp = f.gaps
    if not len(gp.start) or not len(region):
        return []
    has = gp.node >= 0
    m = np.zeros(len(gp.start), dtype=bool)
    m[has] = region[gp.node[has]]
    if extra_gap_mask is not None:
        m |= extra_gap_mask
    us = float(gp.dur[m].sum()) / NS_PER_US
    return [Claim(GPU_IDLE, f.rank, us)] if us > 0 else []


def steps_with(f: RankFacts, nodes: np.ndarray) -> list[int]:
    """Step numbers in which any of the nodes starts."""
    idx = f.steps.index_of(f.tree.start[nodes]) if nodes.any() else np.zeros(0, np.int64)
    idx = idx[idx >= 0]
    return sorted({int(f.steps.number[i]) for i in idx})


def python_frame(name: str) -> tuple[str, str]:
    """('file.py', 'function') of a Python frame label 'path/file.py(12): function'."""
    m = re.match(r"(.*?)\(\d+\): (.*)$", name)
    if not m:
        return "", name
    return m.group(1).rsplit("/", 1)[-1], m.group(2)


def user_python(f: RankFacts) -> np.ndarray:
    """Mask of Python frames that are the user's own code (not a library, not the interpreter)."""
    return f.node_mask(lambda s: not is_library_frame(s) and "(" in s and not s.startswith("<"), (PYTHON,))


def ops_mask(f: RankFacts) -> np.ndarray:
    return f.tree.kind == OP if len(f.tree) else np.zeros(0, dtype=bool)


def removal_edit(f: RankFacts, roots: np.ndarray, code: str, acts: np.ndarray | None = None):
    """The fix "this work no longer runs": the host time inside the nodes ``roots`` removed, and
    the replay actions ``acts`` (default: every action inside them: launches, copies, syncs) with
    their costs and kernels. Returns (edit, the actions removed)."""
    g = f.graph
    e = f.edit(code)
    e.gap_remove += f.gap_time_in(f.union_of_nodes(roots))
    acts = f.actions_in(f.under(roots)) if acts is None else acts
    e.cost_remove[acts] = g.cost[acts]
    if g.n_ops:
        e.drop_op[acts[g.o_action]] = True
    return e, acts


def drop_kernels(e, g, ops: np.ndarray) -> None:
    """In edit ``e`` of graph ``g``: the GPU ops ``ops`` (indices or a mask) no longer run, and
    their launch calls' host cost is gone with them (a fused kernel, a removed conversion)."""
    e.drop_op[ops] = True
    acts = g.o_action[ops]
    e.cost_remove[acts] = g.cost[acts]


def offload_edit(f: RankFacts, nodes: np.ndarray, code: str, workers: int = 1):
    """The fix "run this host work elsewhere, ahead of the GPU": its host time leaves the
    training thread's lane, but the step cannot get shorter than that work divided among
    ``workers`` (it still has to be done once per step). Returns (edit, work ns per step)."""
    e = f.edit(code)
    u = f.union_of_nodes(nodes)
    e.gap_remove += f.gap_time_in(u)
    # the same work, in replay units: the recorded time inside the nodes, scaled as the lane is
    g = f.graph
    raw = np.maximum(g.gap_raw, 0)
    scale = float(np.maximum(g.gap, 0).sum() / raw.sum()) if raw.sum() > 0 else 1.0
    work = u.covered(np.array([g.lo]), np.array([g.hi]))[0] * scale / max(len(f.steps), 1)
    e.min_step_ns = work / max(workers, 1)
    return e, work


def torch_work_below(f: RankFacts) -> np.ndarray:
    """Mask of tree nodes that contain torch work (an op or a CUDA call) anywhere below them."""
    tree = f.tree
    has_work = np.zeros(len(tree), dtype=bool)
    cur = np.nonzero((tree.kind == OP) | (tree.kind == RUNTIME))[0]
    seen = np.zeros(len(tree), dtype=bool)
    while len(cur):
        p = tree.parent[cur]
        p = p[(p >= 0)]
        p = p[~seen[p]]
        seen[p] = True
        has_work[p] = True
        cur = p
    return has_work


def transfer_edits(facts: list[RankFacts], code: str, transfer: dict) -> dict:
    """Per rank, an edit giving matched collectives new transfer times (ns, by collective id):
    a change of the interconnect or of the collectives themselves is made on every rank."""
    edits = {}
    for f in facts:
        e = f.edit(code)
        e.c_transfer = transfer
        edits[f.rank] = e
    return edits


def descend_to_leaf(f: RankFacts, node: int, share: float) -> int:
    """The innermost node under ``node`` reached by following, from each node, the child that holds
    at least ``share`` of it: the frame (or builtin) that holds the time."""
    tree = f.tree
    cache = f.extra.setdefault("_children", None)
    if cache is None or len(cache[0]) != len(tree):
        order = np.argsort(tree.parent, kind="stable")
        cache = (order, tree.parent[order])
        f.extra["_children"] = cache
    order, sorted_parent = cache
    cur = node
    while True:
        lo, hi = np.searchsorted(sorted_parent, [cur, cur + 1])
        kids = order[lo:hi]
        if not len(kids):
            return cur
        dur = tree.end[kids] - tree.start[kids]
        k = int(np.argmax(dur))
        if dur[k] < share * max(float(tree.end[cur] - tree.start[cur]), 1.0):
            return cur
        cur = int(kids[k])


def owned_actions(f: RankFacts) -> np.ndarray:
    """Per replay action: whether its host node lies in a region an earlier cause owns (its fix
    removes the action: a copy inside a checkpoint the checkpoint's cause removes)."""
    owned = f.extra.get("owned_nodes")
    an = f.action_nodes()
    out = np.zeros(len(an), dtype=bool)
    if owned is None or len(owned) != len(f.tree) or not owned.any():
        return out
    ok = an >= 0
    out[ok] = owned[an[ok]]
    return out


def stream_runs(g, member: np.ndarray, min_len: int = 1) -> list[np.ndarray]:
    """The maximal runs of consecutive member ops of the replay graph ``g`` on one stream (graph op
    indices each, in launch order; any other op between two breaks a run), of ``min_len`` ops or more."""
    order = np.lexsort((np.arange(g.n_ops), g.o_stream))  # per stream, in launch order
    m = member[order]
    st = g.o_stream[order]
    brk = np.r_[True, (m[1:] != m[:-1]) | (st[1:] != st[:-1])]  # membership or the stream changes
    starts = np.nonzero(brk)[0]
    ends = np.r_[starts[1:], len(order)]
    return [order[a:b] for a, b in zip(starts.tolist(), ends.tolist()) if m[a] and b - a >= min_len]


def owned_before(f: RankFacts, code: str) -> np.ndarray:
    """Per replay action: in a host region owned by a cause found before ``code``'s first
    detector in registry order (as :func:`owned_actions` is at that detector's turn, also when it
    is asked later: a job detector's per-rank condition is computed after every rank detector)."""
    from aiprof.diagnosis.causes import REGISTRY  # the registry imports this module

    order: dict[str, int] = {}
    for i, d in enumerate(REGISTRY):
        order.setdefault(d.code, i)
    mine = order.get(code, len(REGISTRY))
    an = f.action_nodes()
    owned = np.zeros(len(f.tree), dtype=bool)
    for c in f.extra.get("found", []):
        if order.get(c.code, len(REGISTRY)) < mine and c.region is not None and len(c.region) == len(owned):
            owned |= c.region
    out = np.zeros(len(an), dtype=bool)
    ok = an >= 0
    out[ok] = owned[an[ok]]
    return out


def named_intervals(table, pred) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ts, end, tid) of the rows of ``table`` whose name satisfies ``pred``."""
    names = table.strings("name")
    ok = np.array([bool(pred(s)) for s in names.labels] + [False])[names.codes] if len(table) else np.zeros(0, bool)
    ts = np.asarray(table["ts"])[ok]
    return ts, ts + np.asarray(table["dur"])[ok], np.asarray(table["tid"])[ok]


#: a title names this many modules at most, then "and N more"
NAMED_MODULES = 4


def some_of(names: list[str], most: int = NAMED_MODULES) -> str:
    """The first ``most`` names, then how many more: "blocks.0, blocks.1, blocks.2, blocks.3 and 2 more"."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def actions_inside(f: RankFacts, outer: tuple) -> np.ndarray:
    """Per replay action: a recorded call (runtime row) that starts inside one of the ``outer``
    intervals (ts, end, tid) of its own thread."""
    g, rt = f.graph, f.rt.runtime
    acts = np.zeros(g.n_actions, dtype=bool)
    real = np.nonzero(g.a_row >= 0)[0]
    if len(real) and len(rt):
        rows = g.a_row[real]
        acts[real] = inside_intervals(np.asarray(rt["ts"])[rows], np.asarray(rt["tid"])[rows], outer)
    return acts


def inside_intervals(ts: np.ndarray, tid: np.ndarray, outer: tuple) -> np.ndarray:
    """Which of the events (``ts``, ``tid``) start inside one of the ``outer`` intervals of
    their own thread (``outer``: ts, end, tid, as from :func:`named_intervals`)."""
    o_ts, o_end, o_tid = outer
    out = np.zeros(len(ts), dtype=bool)
    for t in np.unique(tid):
        m, om = tid == t, o_tid == t
        if not om.any():
            continue
        order = np.argsort(o_ts[om], kind="stable")
        starts, ends = o_ts[om][order], np.maximum.accumulate(o_end[om][order])
        k = np.searchsorted(starts, ts[m], side="right") - 1
        out[m] = (k >= 0) & (ends[np.maximum(k, 0)] > ts[m])
    return out


def host_collective_bytes(f: RankFacts, coll: str, nelems: str, outer: tuple, any_thread: bool = False) -> float:
    """Bytes per step of the rank's host-side ``coll`` records ("AllGather", "ReduceScatter"...)
    that start inside the ``outer`` intervals (ts, end, tid; ``any_thread``: on any thread, the
    intervals' tid ignored), counted by ``nelems`` ("in_nelems" or "out_nelems") and the dtype."""
    c = f.rt.collectives
    if not len(c) or not len(outer[0]):
        return 0.0
    m = (c.strings("coll").values() == coll) & (c.strings("side").values() == "cpu")
    ts = np.asarray(c["ts"])
    if any_thread:
        m &= inside_intervals(ts, np.full(len(ts), -1), (outer[0], outer[1], np.full(len(outer[0]), -1)))
    else:
        m &= inside_intervals(ts, np.asarray(c["tid"]), outer)
    if not m.any():
        return 0.0
    size = np.array([DTYPE_BYTES.get(str(d), 4) for d in c.strings("dtype").values()[m]])
    return float((np.asarray(c[nelems])[m] * size).sum()) / max(len(f.steps), 1)
