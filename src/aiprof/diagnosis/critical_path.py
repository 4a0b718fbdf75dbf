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

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import ANNOTATION, OP, PYTHON, RUNTIME
from aiprof.analysis.hotspots import KIND_NAMES as HOST_EVENT_KINDS
from aiprof.analysis.kernels import kernel_family
from aiprof.analysis.loading import is_library_frame
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import COLL_END, COLL_START, STEP
from aiprof.diagnosis.leafnames import leaf_display
from aiprof.diagnosis.replay import Edit, Trace, replay
from aiprof.trace import classify

# segment kinds
HOST, CALL, LATENCY, DELAY, GPU, TRANSFER, WAIT = range(7)
KIND_NAMES = ("host", "cuda call", "launch latency", "gpu delay", "gpu", "collective", "wait for ranks")
# Segments during which the GPU waited for the host: what a host-side fix can give back. (A GPU
# start delay the trace does not explain is no host's doing: a wait on another stream the graph
# does not model, say; it stays a leaf of its own.)
LOSS_KINDS = frozenset({HOST, CALL, LATENCY})
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
    # what removing the leaf's time removes, as a replay edit: its host work (the action whose gap
    # holds each piece, the host node, replayed ns), its calls' own cost (action, ns), the ops
    # whose launch latency it is
    piece_action: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    piece_node: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    piece_ns: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cost_action: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cost_ns: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ops: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    # the GPU waits for it (host work, a call, a launch's latency, on a rank with a GPU); without
    # a GPU the host's time is the work itself
    loss: bool = False


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
    complete: bool = True  # False: the walk ran out of WALK_VISITS_PER_EVENT before the window's start


# Each event is reached at most a few times going back (an action by its end and its start, an op
# by its end and its launch, a collective by its end, its arrival and its wait): a walk longer than
# this many visits per event is going round in a loop, and stops rather than hang the report.
WALK_VISITS_PER_EVENT = 4
WALK_VISITS_SLACK = 8


def walk(f: RankFacts, edit: Edit | None = None) -> CriticalPath:
    """Walk the critical path of ``f``'s baseline back from the window's end (the baseline's own
    trace: on ranks coupled by collectives, the joint replay's, with the others' replayed
    arrivals), or of a replay with ``edit`` (the others' recorded arrivals)."""
    g = f.graph
    res = f.base if edit is None and f.base.trace is not None else replay(g, edit, trace=Trace())
    tr = res.trace
    assert tr is not None
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
    for j, s, dropped in zip(range(n_o), g.o_stream.tolist(), drop.tolist()):  # lists: no numpy scalar per op
        if dropped:
            continue
        prev_on[j] = last.get(s, -1)
        last[s] = j
    opened = np.nonzero(g.a_kind[:n_a] == COLL_START)[0]
    coll_start = dict(zip(g.a_coll[opened].tolist(), opened.tolist())) if g.a_coll is not None else {}
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
    # the walk visits one event at a time: it indexes lists (a list index costs a fraction of a
    # numpy scalar's; the values, and so the path, are the same)
    a_start_l, a_end_l, o_ready_l, o_end_l = a_start.tolist(), a_end.tolist(), o_ready.tolist(), o_end.tolist()
    a_wait_l, a_kind_l = g.a_wait.tolist(), g.a_kind.tolist()
    o_action_l, o_delay_l = g.o_action.tolist(), g.o_delay.tolist()
    a_coll_l = g.a_coll.tolist() if g.a_coll is not None else None
    o_coll_l = g.o_coll.tolist() if g.o_coll is not None else None
    drop_l, packed_l, no_wait_l, gap_l = drop.tolist(), packed.tolist(), no_wait.tolist(), gap.tolist()
    cur_before_l, src_l, prev_on_l = cur_before.tolist(), src.tolist(), prev_on.tolist()
    state, i = (("o", int(np.argmax(np.where(drop[:n_o], -np.inf, o_end)))) if gpu_end > host_end
                else ("a_end", int(np.argmax(a_end))) if n_a else ("done", -1))
    complete = False
    for _ in range(WALK_VISITS_PER_EVENT * (n_a + n_o) + WALK_VISITS_SLACK):
        if state == "done":
            complete = True
            break
        if state == "a_end":
            st, en = a_start_l[i], a_end_l[i]
            w = a_wait_l[i]
            if a_kind_l[i] == COLL_END and not no_wait_l[i] and en > st:
                c = a_coll_l[i]
                arr_i = coll_start.get(c, -1)
                arr = a_start_l[arr_i] if arr_i >= 0 else st
                tx = float(transfer.get(c, 0.0))
                add(TRANSFER, i, tx, en)
                add(WAIT, i, en - tx - arr, en - tx)
                state, i = ("a_start", arr_i) if arr_i >= 0 else ("a_start", i)
            elif w >= 0 and w < n_o and not no_wait_l[i] and o_end_l[w] > st:
                add(CALL, i, en - o_end_l[w], en)
                state, i = "o", w
            else:
                add(CALL, i, en - st, en)
                state = "a_start"
        elif state == "a_start":
            st = a_start_l[i]
            if i == 0:
                add(HOST, 0, st - lo, st)
                state = "done"
            elif cur_before_l[i] + gap_l[i] >= a_start_l[i - 1]:
                add(HOST, i, st - cur_before_l[i], st)
                state, i = ("a_end", int(src_l[i])) if src_l[i] >= 0 else ("done", -1)
            else:
                i -= 1
        else:  # an op's end
            j = i
            en, ready = o_end_l[j], o_ready_l[j]
            act = o_action_l[j]
            if drop_l[j]:
                state, i = "a_start", act
                continue
            c = o_coll_l[j] if o_coll_l is not None else -1
            if c >= 0 and c in transfer:
                tx = float(transfer[c])
                add(TRANSFER, j, tx, en, False)
                add(WAIT, j, en - tx - ready, en - tx, False)
            else:
                add(GPU, j, en - ready, en, False)
            t = ready
            if not packed_l[j]:
                d = float(o_delay_l[j])
                add(DELAY, j, d, t, False)
                t -= d
            cands = []
            p = prev_on_l[j]
            if p >= 0:
                cands.append((o_end_l[p] + (pgap if packed_l[j] else 0.0), "tail", p))
            cands.append((a_start_l[act] + (0.0 if packed_l[j] else lat), "launch", act))
            for dd in g.o_deps.get(j, ()) if not packed_l[j] else ():
                cands.append((o_end_l[int(dd)], "dep", int(dd)))
            v, how, k = max(cands, key=lambda x: x[0])
            if how == "tail":
                add(LATENCY, j, t - o_end_l[p], t, False)
                state, i = "o", p
            elif how == "launch":
                add(LATENCY, j, t - a_start_l[act], t, False)
                state, i = "a_start", act
            else:
                add(LATENCY, j, t - v, t, False)
                state, i = "o", k
    return CriticalPath(res.total_ns, np.array(kinds, np.int8), np.array(idx, np.int64), np.array(nss),
                        np.array(ends), np.array(acts, dtype=bool), tr, complete or state == "done")


# ---------------------------------------------------------------------------------------- leaves
# Frames that never name a leaf's site on a stack without user frames: builtins, and torch's
# generic helpers that every library goes through (an Event.record's caller in torch/cuda/streams.py
# says nothing; FSDP's _fsdp_state.py(130): _root_pre_forward above it does).
_NOT_A_SITE = ("<built-in", "torch/cuda/", "torch/utils/", "torch/_dynamo/", "torch/autograd/", "torch/_ops.py",
               "torch/nn/modules/module.py", "contextlib.py", "functools.py", "threading.py",
               "torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py",
               "aiprof/")  # the agent's own wrappers around the job's collectives


@dataclass
class _Nodes:
    """Per host-tree node, computed once per rank (one vectorised pass per tree depth): the node a
    leaf names (a CUDA call's time is its caller's), the nearest user frame, the nearest op, and
    for frames inside a library the library call the user's code made. ``user`` is, on a stack
    without a user frame, the nearest library frame above the node."""

    named: np.ndarray
    user: np.ndarray
    op: np.ndarray
    entry: np.ndarray


def _nodes(f: RankFacts) -> _Nodes:
    got = f.extra.get("_leaf_nodes")
    if got is not None:
        return got
    tree = f.tree
    n = len(tree)
    ids = np.arange(n, dtype=np.int64)
    is_user = f.node_mask(lambda s: not is_library_frame(s), (PYTHON,)) if n else np.zeros(0, bool)
    is_op = tree.kind == OP if n else np.zeros(0, bool)
    user = np.where(is_user, ids, -1)
    op = np.where(is_op, ids, -1)
    entry = np.full(n, -1, np.int64)
    # where nothing of the user's is on the stack (FSDP's or DDP's hooks, the autograd engine's
    # thread), the site is the nearest library frame that is not one of torch's generic helpers
    is_frame = f.node_mask(lambda s: not s.startswith(_NOT_A_SITE), (PYTHON,)) if n else np.zeros(0, bool)
    frame = np.where(is_frame, ids, -1)
    lib_site = np.full(n, -1, np.int64)
    for idx in f._by_depth():  # shallowest first: a node's parent is done before it
        p = tree.parent[idx]
        ok = p >= 0
        i, pp = idx[ok], p[ok]
        user[i] = np.where(is_user[i], i, user[pp])
        op[i] = np.where(is_op[i], i, op[pp])
        entry[i] = np.where(is_user[pp], i, entry[pp])
        frame[i] = np.where(is_frame[i], i, frame[pp])
        lib_site[i] = frame[pp]
    user = np.where(user >= 0, user, lib_site)
    named = np.where((tree.kind == RUNTIME) & (tree.parent >= 0), tree.parent, ids) if n else ids
    got = f.extra["_leaf_nodes"] = _Nodes(named, user, op, entry)
    return got


def _name_of(f: RankFacts, node: int) -> str:
    return f.tree.name(node) if node >= 0 else ""


def _host_label(f: RankFacts, nodes: _Nodes, node: int) -> tuple[str, str, str, str, str]:
    """(kind, name, site, event kind, entry) of a host node as a leaf: an op's own time is its
    dispatch; a frame inside a library also names the library call the user's code made."""
    if node < 0:
        return KIND_NAMES[HOST], UNTRACED, "", "", ""
    node = int(nodes.named[node])
    tree = f.tree
    name = tree.name(node)
    site = _name_of(f, int(nodes.user[node]))
    e = int(nodes.entry[node])
    entry = _name_of(f, e) if tree.kind[node] == PYTHON and e != node else ""
    return KIND_NAMES[HOST], name, "" if site == name else site, HOST_EVENT_KINDS[int(tree.kind[node])], entry


def _call_label(f: RankFacts, nodes: _Nodes, action: int) -> tuple[str, str, str]:
    name = f.graph.action_name(action)
    node = int(f.action_nodes()[action])
    op = int(nodes.op[node]) if node >= 0 else -1
    site = _name_of(f, op) if op >= 0 else (_name_of(f, int(nodes.user[node])) if node >= 0 else "")
    return KIND_NAMES[CALL], name or "marker", site


def _wrapper_spans(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, tid, node) of FSDP's annotations in the host tree, each with its recorded end
    (with Python stacks the tree clips an annotation to its record_function's enter call, so the
    calls it holds are not its descendants there). A communication kernel launched inside one is
    named by it (which module's all-gather), not by the record_param_comms op that launched it."""
    got = f.extra.get("_wrapper_spans")
    if got is not None:
        return got
    tree = f.tree
    m = f.node_mask(lambda s: s.startswith(classify.FSDP_ANNOTATIONS), (ANNOTATION,)) if len(tree) \
        else np.zeros(0, bool)
    idx = np.nonzero(m)[0]
    an = f.rt.annotations
    start = tree.start[idx]
    end = tree.end[idx].astype(np.float64)
    if len(idx) and len(an):
        end = np.maximum(end, np.asarray(an["ts"])[tree.row[idx]] + np.asarray(an["dur"])[tree.row[idx]])
    got = f.extra["_wrapper_spans"] = (start, end, tree.tid[idx], idx)
    return got


def _wrapped_comm(f: RankFacts, ops: np.ndarray, node: np.ndarray, op: np.ndarray) -> np.ndarray:
    """``op`` (the launching op of GPU ops ``ops``, whose launches are host nodes ``node``), with a
    communication kernel's replaced by the innermost distributed wrapper's annotation open on its
    thread when it was launched, where there is one."""
    if not len(ops) or not len(f.tree) or not len(f.rt.kernels):
        return op
    ws, we, wt, wn = _wrapper_spans(f)
    if not len(wn):
        return op
    g, tree = f.graph, f.tree
    comm = f.extra.get("_comm_kernels")
    if comm is None:  # asked once per leaf label: computed once per rank
        comm = f.rt.kernels.strings("cls").isin_labels(lambda s: s == classify.COMMUNICATION)
        f.extra["_comm_kernels"] = comm
    is_k = g.o_table[ops] == 0
    hit = np.zeros(len(ops), dtype=bool)
    hit[is_k] = comm[g.o_row[ops[is_k]]]
    out = op.copy()
    for k in np.nonzero(hit & (node >= 0))[0]:
        t, tid = tree.start[node[k]], tree.tid[node[k]]
        inside = (wt == tid) & (ws <= t) & (we >= t)
        if inside.any():
            out[k] = wn[inside][np.argmax(ws[inside])]  # the innermost: the latest to open
    return out


def _op_label(f: RankFacts, nodes: _Nodes, j: int, kind: int, memo: dict) -> tuple[str, str, str]:
    if kind == LATENCY:
        return KIND_NAMES[LATENCY], "kernel launch latency", ""
    if kind == DELAY:
        return KIND_NAMES[DELAY], "GPU start delay the trace does not explain", ""
    g = f.graph
    table = f.rt.kernels if g.o_table[j] == 0 else f.rt.table("memops")
    code = int(table.strings("name").codes[g.o_row[j]])
    node = int(f.action_nodes()[int(g.o_action[j])])
    op, user = (int(nodes.op[node]), int(nodes.user[node])) if node >= 0 else (-1, -1)
    op = int(_wrapped_comm(f, np.array([j]), np.array([node]), np.array([op]))[0])
    key = (int(g.o_table[j]), code, kind, f.tree.code[op] if op >= 0 else -1, f.tree.code[user] if user >= 0 else -1)
    got = memo.get(key)
    if got is not None:
        return got
    name = table.strings("name").labels[code]
    if g.o_table[j] == 0:
        cls = classify.kernel_class(name)
        label = (f"{classify.collective_type(name) or 'collective'} ({kernel_family(name)})"
                 if cls == classify.COMMUNICATION else kernel_family(name))
    else:
        label, cls = name, "memory"
    # who issued it: the op that launched it, and the user's frame
    issuer = " at ".join(x for x in (_name_of(f, op), _name_of(f, user)) if x)
    if kind == WAIT:
        got = (KIND_NAMES[WAIT], f"{label}: waiting for the other ranks", issuer)
    elif kind == TRANSFER:
        got = (KIND_NAMES[TRANSFER], label, issuer)
    else:
        got = (KIND_NAMES[GPU], f"{label} [{cls}]", issuer)
    memo[key] = got
    return got


def _gap_pieces(f: RankFacts, actions: np.ndarray, replayed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the host work before each action (replayed ns) over the innermost host events open in
    its recorded gap, in proportion: (action, node or -1, ns) arrays. On the main thread the
    timeline says which event is innermost at each instant (time with none open is -1); work
    before a call on another thread (the autograd engine's) belongs to the event that made it."""
    g, tree = f.graph, f.tree
    z = np.zeros(0, np.int64)
    if not len(actions):
        return z, z, np.zeros(0)
    prev = np.concatenate([[g.lo], np.maximum.accumulate(g.a_end)[:-1]]).astype(np.float64)
    lo_r, hi_r = prev[actions], g.a_ts[actions].astype(np.float64)
    nodes = f.action_nodes()[actions]
    owner = np.where(nodes >= 0, tree.parent[np.maximum(nodes, 0)] if len(tree) else -1, -1)
    span = hi_r - lo_r
    main = ((nodes < 0) | (tree.tid[np.maximum(nodes, 0)] == tree.main_tid)) if len(tree) else np.zeros(len(actions), bool)
    ss, se, top = tree.seg_start, tree.seg_end, tree.seg_top
    timeline = main & (span > 0) & (len(ss) > 0)
    k0 = np.searchsorted(se, lo_r, side="right") if len(ss) else np.zeros(len(actions), np.int64)
    k1 = np.searchsorted(ss, hi_r, side="left") if len(ss) else np.zeros(len(actions), np.int64)
    cnt = np.where(timeline, np.maximum(k1 - k0, 0), 0)
    # gaps not split by the timeline: one piece, the calling event's (or none)
    whole = ~timeline
    out_a, out_n, out_ns = [actions[whole]], [owner[whole]], [replayed[whole]]
    rows = np.nonzero(cnt > 0)[0]
    if len(rows):
        rep = np.repeat(rows, cnt[rows])
        first = np.repeat(k0[rows], cnt[rows])
        seg = first + (np.arange(len(rep)) - np.repeat(np.cumsum(cnt[rows]) - cnt[rows], cnt[rows]))
        ov = np.minimum(se[seg], hi_r[rep]) - np.maximum(ss[seg], lo_r[rep])
        ok = ov > 0
        scale = replayed / np.where(span > 0, span, 1.0)
        out_a.append(actions[rep[ok]])
        out_n.append(top[seg[ok]].astype(np.int64))
        out_ns.append(ov[ok] * scale[rep[ok]])
        covered = np.bincount(rep[ok], weights=ov[ok], minlength=len(actions))
    else:
        covered = np.zeros(len(actions))
    # what no event covers, and gaps the timeline holds no segment of
    rest = timeline & (span - covered > 0)
    out_a.append(actions[rest])
    out_n.append(np.full(int(rest.sum()), -1, np.int64))
    out_ns.append((span - covered)[rest] * (replayed / np.where(span > 0, span, 1.0))[rest])
    return np.concatenate(out_a), np.concatenate(out_n).astype(np.int64), np.concatenate(out_ns)


def _norm_ids(f: RankFacts) -> np.ndarray:
    """Per tree label code, an id of the label without line numbers (with a trailing -1 slot): a
    frame's line varies with where the profiler caught it, not with what the function is."""
    got = f.extra.get("_leaf_norm")
    if got is None:
        ids: dict[str, int] = {}
        got = np.array([ids.setdefault(_LINE.sub("", s), len(ids)) for s in f.tree.labels] + [-1], np.int64)
        f.extra["_leaf_norm"] = got
    return got


def leaves(f: RankFacts, path: CriticalPath | None = None) -> list[Leaf]:
    """The rank's critical path grouped by leaf, largest first (their ns add up to the window):
    every segment (host work split over its events) gets a key of integers, the keys are grouped
    at once and each distinct leaf is named from its first segment."""
    path = path or walk(f)
    g, tree = f.graph, f.tree
    nodes = _nodes(f)
    norm = _norm_ids(f)
    code = np.append(tree.code, len(norm) - 1) if len(tree) else np.zeros(1, np.int64) + (len(norm) - 1)

    def nid(node: np.ndarray) -> np.ndarray:  # normalised label id of nodes (-1: none)
        return norm[code[np.where(node >= 0, node, len(code) - 1)]]

    host = path.kind == HOST
    pa, pn, pns = _gap_pieces(f, path.index[host], path.ns[host])
    named = np.where(pn >= 0, nodes.named[np.maximum(pn, 0)], -1) if len(tree) else np.full(len(pn), -1)
    user_h = np.where(named >= 0, nodes.user[np.maximum(named, 0)], -1) if len(tree) else named
    rows = [np.stack([np.full(len(pa), HOST), nid(named), nid(user_h), np.zeros(len(pa), np.int64)], 1)]
    item_ns, item_action, item_ref, item_kind = [pns], [pa], [pn], [np.full(len(pa), HOST)]
    an = f.action_nodes()
    rest = ~host
    k, i, ns, on_a = path.kind[rest].astype(np.int64), path.index[rest], path.ns[rest], path.on_action[rest]
    call = k == CALL
    ca = i[call]
    cnode = an[ca] if len(an) else np.zeros(0, np.int64)
    cop = np.where(cnode >= 0, nodes.op[np.maximum(cnode, 0)], -1) if len(tree) else cnode
    cuser = np.where((cnode >= 0) & (cop < 0), nodes.user[np.maximum(cnode, 0)], -1) if len(tree) else cnode
    rows.append(np.stack([np.full(len(ca), CALL), g.a_code[ca], nid(cop), nid(cuser)], 1))
    item_ns.append(ns[call]); item_action.append(ca); item_ref.append(ca); item_kind.append(k[call])
    hc = on_a & ~call  # a collective run by a host backend (gloo)
    zero = np.zeros(int(hc.sum()), np.int64)
    rows.append(np.stack([k[hc] + len(KIND_NAMES), zero, zero, zero], 1))  # kinds apart from the GPU's
    item_ns.append(ns[hc]); item_action.append(i[hc]); item_ref.append(i[hc]); item_kind.append(k[hc])
    op = ~on_a & ~call
    oj, ok = i[op], k[op]
    onode = an[g.o_action[oj]] if len(oj) else np.zeros(0, np.int64)
    oop = np.where(onode >= 0, nodes.op[np.maximum(onode, 0)], -1) if len(tree) else onode
    oop = _wrapped_comm(f, oj, onode, oop)
    ouser = np.where(onode >= 0, nodes.user[np.maximum(onode, 0)], -1) if len(tree) else onode
    anon = (ok == LATENCY) | (ok == DELAY)  # one leaf each, whatever the op
    ocode = np.zeros(len(oj), np.int64)
    if len(oj):
        kc = f.rt.kernels.strings("name").codes if len(f.rt.kernels) else np.zeros(0, np.int64)
        m = f.rt.table("memops")
        mc = m.strings("name").codes if len(m) else np.zeros(0, np.int64)
        is_k = g.o_table[oj] == 0
        ocode[is_k] = kc[g.o_row[oj[is_k]]]
        ocode[~is_k] = mc[g.o_row[oj[~is_k]]].astype(np.int64) + (1 << 32)  # apart from kernel codes
    rows.append(np.stack([ok, np.where(anon, -1, ocode), np.where(anon, -1, nid(oop)), np.where(anon, -1, nid(ouser))], 1))
    item_ns.append(ns[op]); item_action.append(g.o_action[oj] if len(oj) else oj); item_ref.append(oj); item_kind.append(ok)
    rows_a = np.concatenate(rows).astype(np.int64)
    item_ns_a, item_action_a = np.concatenate(item_ns), np.concatenate(item_action).astype(np.int64)
    item_ref_a, item_kind_a = np.concatenate(item_ref).astype(np.int64), np.concatenate(item_kind).astype(np.int64)
    if not len(rows_a):
        return []
    keys, first, inv = npx.unique_rows(rows_a)
    totals = np.bincount(inv, weights=item_ns_a, minlength=len(keys))
    step_of_action = np.cumsum(g.a_kind == STEP) - 1  # STEP markers open each step
    numbers = g.step_number
    n_steps = max(len(numbers), 1)
    st = np.clip(step_of_action[np.clip(item_action_a, 0, max(len(step_of_action) - 1, 0))], 0, n_steps - 1) \
        if len(step_of_action) else np.zeros(len(inv), np.int64)
    by_step = np.bincount(inv * n_steps + st, weights=item_ns_a, minlength=len(keys) * n_steps).reshape(len(keys), n_steps)
    order = np.argsort(inv, kind="stable")
    bounds = np.searchsorted(inv[order], np.arange(len(keys) + 1))
    step_numbers = numbers.tolist()
    memo: dict = {}
    out = []
    for u in range(len(keys)):
        j = int(first[u])
        kind, ref = int(item_kind_a[j]), int(item_ref_a[j])
        if kind == HOST:
            label = _host_label(f, nodes, ref)
        elif kind == CALL:
            label = (*_call_label(f, nodes, ref), "", "")
        elif keys[u][0] >= len(KIND_NAMES):
            what = "the collective" if kind == TRANSFER else "the collective: waiting for the other ranks"
            label = (KIND_NAMES[kind], f"{what} (host backend)", _issuer(f, ref), "", "")
        else:
            label = (*_op_label(f, nodes, ref, kind, memo), "", "")
        lf = Leaf("|".join(map(str, keys[u].tolist())), *label)
        lf.ns = float(totals[u])
        lf.loss = f.has_gpu and kind in LOSS_KINDS
        lf.by_step_ns = {step_numbers[s_]: v for s_, v in enumerate(by_step[u].tolist()) if v} if len(numbers) else {}
        if kind in (HOST, CALL, LATENCY):  # what a cause may claim (CPU-only ranks too)
            mine = order[bounds[u]:bounds[u + 1]]
            if kind == HOST:
                lf.piece_action, lf.piece_node, lf.piece_ns = item_action_a[mine], item_ref_a[mine], item_ns_a[mine]
            elif kind == CALL:
                lf.cost_action, lf.cost_ns = item_action_a[mine], item_ns_a[mine]
            elif kind == LATENCY:
                lf.ops = item_ref_a[mine]
        out.append(lf)
    return sorted(out, key=lambda lf: -lf.ns)


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
    if len(leaf.piece_ns):
        a, node, ns = leaf.piece_action, leaf.piece_node, leaf.piece_ns
        gap = f.graph.gap[a]
        removed = np.zeros(len(a)) if e.gap_remove is None else e.gap_remove[a]
        share = np.clip(np.divide(removed, gap, out=np.zeros(len(a)), where=gap > 0), 0.0, 1.0)
        if region is not None:
            inside = np.where(node >= 0, region[np.maximum(node, 0)], False)
            share = np.where(node >= 0, inside.astype(np.float64), share)
        out += float((ns * share).sum())
    if len(leaf.cost_ns):
        a = leaf.cost_action
        hit = np.zeros(len(a), bool)
        if e.cost_remove is not None:
            hit |= e.cost_remove[a] > 0
        if e.no_wait is not None:
            hit |= e.no_wait[a]
        out += float(leaf.cost_ns[hit].sum())
    if len(leaf.ops) and e.packed is not None and leaf.ns > 0:
        out += leaf.ns * float(np.mean(e.packed[leaf.ops]))
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
    return {"per_step_us": path.total_ns / n / 1e3, "leaves": rows, "gpu": bool(f.has_gpu),
            "other_per_step_us": rest / n / 1e3, "other_leaves": max(len(lvs) - top, 0),
            "loss_share": sum(lf.ns for lf in lvs if lf.loss) / total,
            # waiting for other ranks, and collectives' own transfer, on the replayed path
            "wait_share": sum(lf.ns for lf in lvs if lf.kind == KIND_NAMES[WAIT]) / total,
            "comm_share": sum(lf.ns for lf in lvs if lf.kind in (KIND_NAMES[WAIT], KIND_NAMES[TRANSFER])) / total,
            # False: the walk stopped early (WALK_VISITS_PER_EVENT); the leaves cover less than the step
            "complete": bool(path.complete)}

