"""The critical path of a rank's replayed window, and the leaf that holds each of its nanoseconds.

The replay (:mod:`aiprof.diagnosis.replay`) decides when the window ends; walking back from that
end through what each event waited for gives one chain of segments that covers the window
exactly: host work between CUDA calls, a call's own cost, the launch latency before a kernel,
a kernel, a collective's transfer and the wait for the other ranks at it. Each segment belongs to
a *leaf* (docs/findings.md, "Leaves"):

* host work: the innermost host event (a Python function, a builtin such as ``gc.collect``, an
  op's own dispatch) open during it, with the user's frame that called it;
* a CUDA call: its name and the op that made it;
* GPU work: the kernel family (with its class) or the copy kind;
* a collective: its type and the op or frame that issued it, and separately the time waited for
  the other ranks to arrive;
* the launch latency and delays the trace does not explain.

The leaves' times add up to the replayed window (a test checks it on real traces). Host work and
CUDA calls on the path are time the GPU waited for the host (*loss*); the causes claim the
segments their fix changes, and what no cause claims is reported by name (causes/unexplained).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from aiprof.analysis.hotspots import KIND_NAMES as HOST_EVENT_KINDS
from aiprof.analysis.hotspots import OP, PYTHON, RUNTIME
from aiprof.analysis.kernels import kernel_family
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import COLL_END, COLL_START
from aiprof.diagnosis.leafnames import leaf_display
from aiprof.diagnosis.replay import Edit, Trace, replay
from aiprof.trace import classify

# segment kinds
HOST, CALL, LATENCY, DELAY, GPU, TRANSFER, WAIT = range(7)
KIND_NAMES = ("host", "cuda call", "launch latency", "gpu delay", "gpu", "collective", "wait for ranks")
# Segments during which the GPU waited for the host: what a host-side fix can give back.
LOSS_KINDS = frozenset({HOST, CALL, LATENCY, DELAY})
# The leaf of host time during which no host event was open.
UNTRACED = "host time with no traced event"
# A cause claims a leaf when its fix changes at least this share of the leaf's time (most of it:
# a fix that touches a sliver of a leaf does not explain it).
CLAIMED_SHARE = 0.5
_LINE = re.compile(r"\(\d+\)")
# Leaves the report lists per rank (the rest is summed in one "other" row).
TOP_LEAVES = 12


@dataclass
class Leaf:
    """One named leaf and its replayed time on the critical path (ns over the window)."""

    key: str  # unique within the rank: kind + name + site
    kind: str  # KIND_NAMES
    name: str  # the event's own name (a frame label, an op, a call, a kernel family)
    site: str  # where it is called from: the nearest user frame, or the op that made it
    event: str = ""  # host leaves: the event's kind (analysis.hotspots.KIND_NAMES: python, op, ...)
    entry: str = ""  # host leaves inside a library: the library call the user's code made (torch.save)
    ns: float = 0.0
    by_step_ns: dict = field(default_factory=dict)  # step number -> ns in that step
    # what removing the leaf's time removes, as a replay edit: its host work as (action whose gap
    # holds it, host node, replayed ns), the calls' own cost by action, the ops whose launch
    # latency it is
    pieces: list = field(default_factory=list)
    cost_ns: dict = field(default_factory=dict)
    ops: list = field(default_factory=list)

    @property
    def loss(self) -> bool:
        return self.kind in (KIND_NAMES[k] for k in LOSS_KINDS)


@dataclass
class CriticalPath:
    """A rank's replayed window as segments (kind, action or op index, ns), ordered from the
    window's end back to its start, and the window's length they add up to."""

    total_ns: float
    kind: np.ndarray
    index: np.ndarray
    ns: np.ndarray
    t_end: np.ndarray  # each segment's end (replayed ns, absolute)
    on_action: np.ndarray  # the index is an action's (host work, calls, host collectives), else an op's
    trace: Trace


def walk(f: RankFacts, edit: Edit | None = None) -> CriticalPath:
    """Replay ``f``'s graph (with ``edit``) and walk its critical path back from the window's end."""
    g = f.graph
    tr = Trace()
    res = replay(g, edit, trace=tr)
    eff = tr.effective
    a_start, a_end = np.asarray(tr.a_start), np.asarray(tr.a_end)
    o_ready, o_end = np.asarray(tr.o_ready), np.asarray(tr.o_end)
    n_a, n_o = len(a_start), len(o_end)
    lo = float(g.lo)
    gap = eff["gap"]
    drop, packed, no_wait = eff["drop"], eff["packed"], eff["no_wait"]
    transfer = eff["transfer"]
    # the host cursor before each action: the latest end of the actions before it, and which one
    if n_a:
        cm = np.maximum.accumulate(a_end)
        arg = np.maximum.accumulate(np.where(a_end == cm, np.arange(n_a), 0))
        cur_before = np.concatenate([[lo], np.maximum(cm[:-1], lo)])
        src = np.concatenate([[-1], np.where(cm[:-1] > lo, arg[:-1], -1)])
    else:
        cur_before = src = np.zeros(0)
    # the op before each op on its stream (dropped ops never hold a stream)
    prev_on = np.full(n_o, -1, np.int64)
    last: dict[int, int] = {}
    for j in range(n_o):
        if drop[j]:
            continue
        s = int(g.o_stream[j])
        prev_on[j] = last.get(s, -1)
        last[s] = j
    coll_start = {int(g.a_coll[i]): i for i in range(n_a) if g.a_kind[i] == COLL_START} if g.a_coll is not None else {}
    kinds: list[int] = []
    idx: list[int] = []
    nss: list[float] = []
    ends: list[float] = []
    acts: list[bool] = []

    def add(k: int, i: int, ns: float, t: float, act: bool = True) -> None:
        if ns:
            kinds.append(k)
            idx.append(i)
            nss.append(float(ns))
            ends.append(t)
            acts.append(act)

    host_end = float(a_end.max()) if n_a else lo
    gpu_end = float(o_end[~drop[:n_o]].max()) if n_o and (~drop[:n_o]).any() else lo
    lat = g.launch_latency_ns
    pgap = eff["packed_gap_ns"]
    state, i = (("o", int(np.argmax(np.where(drop[:n_o], -np.inf, o_end)))) if gpu_end > host_end
                else ("a_end", int(np.argmax(a_end))) if n_a else ("done", -1))
    for _ in range(4 * (n_a + n_o) + 8):
        if state == "done":
            break
        if state == "a_end":
            st, en = float(a_start[i]), float(a_end[i])
            w = int(g.a_wait[i])
            if g.a_kind[i] == COLL_END and not no_wait[i] and en > st:
                c = int(g.a_coll[i])
                arr_i = coll_start.get(c, -1)
                arr = float(a_start[arr_i]) if arr_i >= 0 else st
                tx = float(transfer.get(c, 0.0))
                add(TRANSFER, i, tx, en)
                add(WAIT, i, en - tx - arr, en - tx)
                state, i = ("a_start", arr_i) if arr_i >= 0 else ("a_start", i)
            elif w >= 0 and w < n_o and not no_wait[i] and o_end[w] > st:
                add(CALL, i, en - float(o_end[w]), en)
                state, i = "o", w
            else:
                add(CALL, i, en - st, en)
                state = "a_start"
        elif state == "a_start":
            st = float(a_start[i])
            if i == 0:
                add(HOST, 0, st - lo, st)
                state = "done"
            elif cur_before[i] + gap[i] >= a_start[i - 1]:
                add(HOST, i, st - float(cur_before[i]), st)
                state, i = ("a_end", int(src[i])) if src[i] >= 0 else ("done", -1)
            else:
                i -= 1
        else:  # an op's end
            j = i
            en, ready = float(o_end[j]), float(o_ready[j])
            act = int(g.o_action[j])
            if drop[j]:
                state, i = "a_start", act
                continue
            c = int(g.o_coll[j]) if g.o_coll is not None else -1
            if c >= 0 and c in transfer:
                tx = float(transfer[c])
                add(TRANSFER, j, tx, en, False)
                add(WAIT, j, en - tx - ready, en - tx, False)
            else:
                add(GPU, j, en - ready, en, False)
            t = ready
            if not packed[j]:
                d = float(g.o_delay[j])
                add(DELAY, j, d, t, False)
                t -= d
            cands = []
            p = int(prev_on[j])
            if p >= 0:
                cands.append((float(o_end[p]) + (pgap if packed[j] else 0.0), "tail", p))
            cands.append((float(a_start[act]) + (0.0 if packed[j] else lat), "launch", act))
            for dd in g.o_deps.get(j, ()) if not packed[j] else ():
                cands.append((float(o_end[dd]), "dep", int(dd)))
            v, how, k = max(cands, key=lambda x: x[0])
            if how == "tail":
                add(LATENCY, j, t - float(o_end[p]), t, False)
                state, i = "o", p
            elif how == "launch":
                add(LATENCY, j, t - float(a_start[act]), t, False)
                state, i = "a_start", act
            else:
                add(LATENCY, j, t - v, t, False)
                state, i = "o", k
    return CriticalPath(res.total_ns, np.array(kinds, np.int8), np.array(idx, np.int64), np.array(nss),
                        np.array(ends), np.array(acts, dtype=bool), tr)


# ---------------------------------------------------------------------------------------- leaves
def _host_label(f: RankFacts, node: int) -> tuple[str, str, str, str, str]:
    """(kind, name, site, event kind, entry) of a host node as a leaf: an op's own time is its
    dispatch; a frame inside a library also names the library call the user's code made."""
    tree = f.tree
    while node >= 0 and tree.kind[node] == RUNTIME:
        node = int(tree.parent[node])
    if node < 0:
        return KIND_NAMES[HOST], UNTRACED, "", "", ""
    name = tree.name(node)
    site = tree.user_site(node)
    entry = ""
    if tree.kind[node] == PYTHON and site and site != name:
        chain = tree.ancestors(node)  # innermost first: the frame just below the user's
        for inner, outer in pairwise(chain):
            if tree.kind[outer] == PYTHON and tree.name(outer) == site:
                entry = tree.name(inner) if inner != node else ""
                break
    return KIND_NAMES[HOST], name, "" if site == name else site, HOST_EVENT_KINDS[int(tree.kind[node])], entry


def _call_label(f: RankFacts, action: int) -> tuple[str, str, str]:
    tree = f.tree
    name = f.graph.action_name(action)
    node = int(f.action_nodes()[action])
    op = int(tree.nearest(np.array([tree.parent[node]]), OP)[0]) if node >= 0 and tree.parent[node] >= 0 else -1
    site = tree.name(op) if op >= 0 else (tree.user_site(node) if node >= 0 else "")
    return KIND_NAMES[CALL], name or "marker", site


def _op_label(f: RankFacts, j: int, kind: int) -> tuple[str, str, str]:
    g = f.graph
    rt = f.rt
    if g.o_table[j] == 0:
        name = rt.kernels.strings("name").labels[rt.kernels.strings("name").codes[g.o_row[j]]]
        cls = classify.kernel_class(name)
        label = (f"{classify.collective_type(name) or 'collective'} ({kernel_family(name)})"
                 if cls == classify.COMMUNICATION else kernel_family(name))
    else:
        m = rt.table("memops")
        name = m.strings("name").labels[m.strings("name").codes[g.o_row[j]]]
        label, cls = name, "memory"
    if kind == LATENCY:
        return KIND_NAMES[LATENCY], "kernel launch latency", ""
    if kind == DELAY:
        return KIND_NAMES[DELAY], "GPU start delay the trace does not explain", ""
    # who issued it: the op that launched it, and the user's frame
    tree = f.tree
    node = int(f.action_nodes()[int(g.o_action[j])])
    issuer = ""
    if node >= 0:
        op = int(tree.nearest(np.array([node]), OP)[0])
        issuer = tree.name(op) if op >= 0 else ""
        site = tree.user_site(node)
        issuer = " at ".join(x for x in (issuer, site) if x)
    k = TRANSFER if kind in (TRANSFER, WAIT) else GPU
    if kind == WAIT:
        return KIND_NAMES[WAIT], f"{label}: waiting for the other ranks", issuer
    return KIND_NAMES[k], f"{label} [{cls}]" if k == GPU else label, issuer


def _gap_pieces(f: RankFacts, actions: np.ndarray, replayed: np.ndarray) -> list[tuple[int, int, float]]:
    """Split the host work before each action (replayed ns) over the innermost host events open in
    its recorded gap, in proportion: (action, node or -1, ns). On the main thread the timeline says
    which event is innermost at each instant; work before a call on another thread (the autograd
    engine's) belongs to the event that made the call."""
    g, tree = f.graph, f.tree
    out: list[tuple[int, int, float]] = []
    if not len(actions):
        return out
    prev = np.concatenate([[g.lo], np.maximum.accumulate(g.a_end)[:-1]])
    lo_r, hi_r = prev[actions].astype(np.float64), g.a_ts[actions].astype(np.float64)
    nodes = f.action_nodes()[actions]
    main = (nodes < 0) | (tree.tid[np.maximum(nodes, 0)] == tree.main_tid) if len(tree) else np.ones(len(actions), bool)
    ss, se, top = tree.seg_start, tree.seg_end, tree.seg_top
    for a, l, h, n, m, rep in zip(actions.tolist(), lo_r, hi_r, nodes.tolist(), main.tolist(), replayed.tolist()):
        span = h - l
        if span <= 0 or not m or not len(ss):
            owner = int(tree.parent[n]) if n >= 0 else -1
            out.append((a, owner, rep))
            continue
        k0 = int(np.searchsorted(se, l, side="right"))
        k1 = int(np.searchsorted(ss, h, side="left"))
        if k1 <= k0:
            out.append((a, -1, rep))
            continue
        ov = np.minimum(se[k0:k1], h) - np.maximum(ss[k0:k1], l)
        tops = top[k0:k1]
        scale = rep / span
        covered = 0.0
        for t, o in zip(tops.tolist(), ov.tolist()):
            if o > 0:
                out.append((a, int(t), o * scale))
                covered += o
        if span - covered > 0:
            out.append((a, -1, (span - covered) * scale))
    return out


def leaves(f: RankFacts, path: CriticalPath | None = None) -> list[Leaf]:
    """The rank's critical path grouped by leaf, largest first (their ns add up to the window)."""
    path = path or walk(f)
    g = f.graph
    step_of_action = np.cumsum(g.a_kind == 3) - 1  # STEP markers open each step
    numbers = g.step_number
    by_key: dict[str, Leaf] = {}

    def put(kind: str, name: str, site: str, event: str, entry: str, ns: float, action: int,
            node: int | None = None, cost: bool = False, op: int = -1) -> None:
        # one leaf per event and calling function: a frame label's line number varies with the
        # line the function was at, not with what it is
        key = f"{kind}|{name}|{_LINE.sub('', site)}"
        lf = by_key.get(key)
        if lf is None:
            lf = by_key[key] = Leaf(key, kind, name, site, event, entry)
        lf.ns += ns
        if 0 <= action < len(step_of_action) and len(numbers):
            s = int(numbers[min(max(int(step_of_action[action]), 0), len(numbers) - 1)])
            lf.by_step_ns[s] = lf.by_step_ns.get(s, 0.0) + ns
        if node is not None:
            lf.pieces.append((action, node, ns))
        if cost:
            lf.cost_ns[action] = lf.cost_ns.get(action, 0.0) + ns
        if op >= 0:
            lf.ops.append(op)

    host = path.kind == HOST
    for a, node, ns in _gap_pieces(f, path.index[host], path.ns[host]):
        put(*_host_label(f, node), ns, a, node=node)
    for k, i, ns, on_a in zip(path.kind.tolist(), path.index.tolist(), path.ns.tolist(), path.on_action.tolist()):
        if k == HOST:
            continue
        if k == CALL:
            put(*_call_label(f, i), "", "", ns, i, cost=True)
        elif on_a:  # a collective run by a host backend (gloo): its start marker's issuer
            what = "the collective" if k == TRANSFER else "the collective: waiting for the other ranks"
            put(KIND_NAMES[k], f"{what} (host backend)", _issuer(f, i), "", "", ns, i)
        else:
            put(*_op_label(f, i, k), "", "", ns, int(g.o_action[i]), op=i if k == LATENCY else -1)
    return sorted(by_key.values(), key=lambda lf: -lf.ns)


def _issuer(f: RankFacts, action: int) -> str:
    """The op and user frame open on the main thread when a host collective's marker was set."""
    node = int(f.tree.innermost_at(np.array([f.graph.a_ts[action]]))[0])
    if node < 0:
        return ""
    op = int(f.tree.nearest(np.array([node]), OP)[0])
    return " at ".join(x for x in ((f.tree.name(op) if op >= 0 else ""), f.tree.user_site(node)) if x)


def rank_path(f: RankFacts) -> tuple[CriticalPath, list[Leaf]]:
    """The baseline's critical path and its leaves (computed once per rank, kept in its facts)."""
    got = f.extra.get("_critical_path")
    if got is None:
        p = walk(f)
        got = f.extra["_critical_path"] = (p, leaves(f, p))
    return got


def claimed_ns(f: RankFacts, leaf: Leaf, cause) -> float:
    """How much of the leaf's time the cause's fix changes: host work inside the host regions the
    cause owns (or, for a cause that names no region, the share of each gap its fix removes), the
    calls whose cost it removes or that no longer wait, the launches it packs into a graph."""
    e = cause.edit
    if e is None:
        return 0.0
    out = 0.0
    region = cause.region if cause.region is not None and len(cause.region) == len(f.tree) else None
    gap = f.graph.gap
    for a, node, ns in leaf.pieces:
        if region is not None and node >= 0:
            out += ns if region[node] else 0.0
        elif e.gap_remove is not None and gap[a] > 0:
            out += ns * min(1.0, float(e.gap_remove[a]) / float(gap[a]))
    for a, ns in leaf.cost_ns.items():
        if (e.cost_remove is not None and e.cost_remove[a] > 0) or (e.no_wait is not None and e.no_wait[a]):
            out += ns
    if leaf.ops and e.packed is not None and leaf.ns > 0:
        out += leaf.ns * float(np.mean(e.packed[np.array(leaf.ops, np.int64)]))
    return min(out, leaf.ns)


def claimed_by(f: RankFacts, leaf: Leaf, causes: list) -> list[str]:
    """Codes of the causes whose fix changes at least CLAIMED_SHARE of the leaf's time."""
    out = []
    for c in causes:
        if c.code not in out and leaf.ns > 0 and claimed_ns(f, leaf, c) >= CLAIMED_SHARE * leaf.ns:
            out.append(c.code)
    return out


def leaf_table(f: RankFacts, causes: list, top: int = TOP_LEAVES) -> dict:
    """The report's per-rank critical path: the replayed window's ns per step, and its largest
    leaves (per step ns, share, whether the GPU waited for it, the causes that claim it)."""
    path, lvs = rank_path(f)
    n = max(len(f.graph.step_number), 1)
    total = max(path.total_ns, 1.0)
    rows = [{"kind": lf.kind, "name": lf.name, "label": leaf_display(lf.name), "site": lf.site, "entry": lf.entry,
             "entry_label": leaf_display(lf.entry) if lf.entry else "", "per_step_us": lf.ns / n / 1e3,
             "share": lf.ns / total, "loss": lf.loss, "claimed_by": claimed_by(f, lf, causes)} for lf in lvs[:top]]
    rest = sum(lf.ns for lf in lvs[top:])
    return {"per_step_us": path.total_ns / n / 1e3, "leaves": rows,
            "other_per_step_us": rest / n / 1e3, "other_leaves": max(len(lvs) - top, 0),
            "loss_share": sum(lf.ns for lf in lvs if lf.loss) / total}

