"""Python and op hotspots, host call trees, GPU-idle attribution and bottleneck ratios.

Definitions in docs/metrics.md ("Hotspots and bottleneck ratio").

The host side of a rank is turned into a call tree per thread: Python frames, torch ops, user
annotations and CUDA runtime/driver calls, nested by time (the profiler records them on the
same clock). From the tree we get, for every node, its exclusive ("self") time and the GPU
time it launched; from the tree of the main thread we get a *timeline* of the innermost host
event at every instant, which is what lets a GPU-idle gap be attributed to what the host was
doing meanwhile. Everything is vectorised: loops run over threads, depths or distinct names,
never over events.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.breakdown import gpu_unions
from aiprof.analysis.comm import exposed_by_type
from aiprof.analysis.intervals import Union, union_of
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.loading import STEP_ANNOTATION as _STEP_ANNOTATION
from aiprof.analysis.loading import (  # noqa: F401 (re-exported)
    is_data_loading,
    is_input_preparation,
    is_library_frame,
    loading_union,
    main_tid,
)
from aiprof.analysis.memo import analysis_cache
from aiprof.analysis.steps import Steps, find_steps, window
from aiprof.trace import classify
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
PYTHON, OP, RUNTIME, ANNOTATION = 0, 1, 2, 3
KIND_NAMES = ("python", "op", "runtime", "annotation")
# Improperly nested events (clock rounding) are clipped to their parent; a few rounds suffice.
_MAX_CLIP_ROUNDS = 8


@dataclass
class HostTree:
    """Host events of one rank nested by time, one tree per thread, concatenated.

    Node arrays are sorted by (tid, start, -end). ``parent`` is -1 for roots. ``end`` is the
    (possibly clipped) end used for nesting. The timeline (``seg_*``) is the innermost node at
    each instant of the *main* thread; ``seg_top`` is -1 where no host event is open.
    """

    kind: np.ndarray
    row: np.ndarray
    code: np.ndarray
    labels: list[str]
    tid: np.ndarray
    start: np.ndarray
    end: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    main_tid: int
    seg_start: np.ndarray
    seg_end: np.ndarray
    seg_top: np.ndarray
    runtime_node: np.ndarray  # node index of each runtime row (-1 if not in the tree)

    def __len__(self) -> int:
        return len(self.kind)

    def name(self, node: int) -> str:
        return self.labels[self.code[node]]

    def exclusive_ns(self) -> np.ndarray:
        """Self time of every node of the main thread (time it is the innermost host event)."""
        out = np.zeros(len(self), dtype=np.int64)
        ok = self.seg_top >= 0
        np.add.at(out, self.seg_top[ok], (self.seg_end - self.seg_start)[ok])
        return out

    def _lists(self) -> tuple[list[int], list[int], list[int]]:
        """parent, kind and code as lists, built once: the Python walks below index them per
        node, and a list index costs a fraction of a numpy scalar's."""
        got = self.__dict__.get("_as_lists")
        if got is None:
            got = self.__dict__["_as_lists"] = (self.parent.tolist(), self.kind.tolist(), self.code.tolist())
        return got

    def ancestors(self, node: int) -> list[int]:
        """The node and its ancestors, innermost first (a short Python walk, for reporting)."""
        parent = self._lists()[0]
        out = []
        node = int(node)
        while node >= 0:
            out.append(node)
            node = parent[node]
        return out

    def stack(self, node: int, kinds: tuple[int, ...] = (PYTHON,)) -> list[str]:
        """Names of the node's ancestors of the given kinds, outermost first."""
        parent, kind, code = self._lists()
        out = []
        node = int(node)
        while node >= 0:
            if kind[node] in kinds:
                out.append(self.labels[code[node]])
            node = parent[node]
        out.reverse()
        return out

    def user_site(self, node: int) -> str:
        """The nearest ancestor Python frame that is user code (not a library), or ""."""
        parent, kind, code = self._lists()
        node = int(node)
        while node >= 0:
            if kind[node] == PYTHON and not is_library_frame(name := self.labels[code[node]]):
                return name
            node = parent[node]
        return ""

    def nearest(self, nodes: np.ndarray, kind: int) -> np.ndarray:
        """For each node, itself or its nearest ancestor of ``kind``; -1 when none (vectorised)."""
        cur = np.asarray(nodes, dtype=np.int64).copy()
        out = np.full(len(cur), -1, dtype=np.int64)
        active = cur >= 0
        while active.any():
            idx = np.nonzero(active)[0]
            hit = self.kind[cur[idx]] == kind
            out[idx[hit]] = cur[idx[hit]]
            nxt = self.parent[cur[idx]]
            cur[idx] = nxt
            active[idx] = ~hit & (nxt >= 0)
        return out

    def outermost(self, nodes: np.ndarray, kind: int) -> np.ndarray:
        """For each node, itself or its outermost ancestor of ``kind``; -1 when none (vectorised)."""
        cur = np.asarray(nodes, dtype=np.int64).copy()
        out = np.full(len(cur), -1, dtype=np.int64)
        idx = np.nonzero(cur >= 0)[0]
        while len(idx):  # one level up per round: a later hit is further out
            c = cur[idx]
            hit = self.kind[c] == kind
            out[idx[hit]] = c[hit]
            nxt = self.parent[c]
            cur[idx] = nxt
            idx = idx[nxt >= 0]
        return out

    def innermost_at(self, ts: np.ndarray) -> np.ndarray:
        """Innermost main-thread node open at each timestamp, or -1."""
        ts = np.asarray(ts, dtype=np.int64)
        if not len(self.seg_start):
            return np.full(len(ts), -1, dtype=np.int64)
        i = np.searchsorted(self.seg_start, ts, side="right") - 1
        ic = np.maximum(i, 0)
        ok = (i >= 0) & (ts < self.seg_end[ic])
        return np.where(ok, self.seg_top[ic], -1)

    def outermost_by_name(self) -> np.ndarray:
        """True for nodes with no ancestor of the same name (so recursion is not counted twice);
        computed once per tree, read-only."""
        got = self.__dict__.get("_outermost_by_name")
        if got is None:
            got = self.__dict__["_outermost_by_name"] = self._outermost_by_name()
            got.flags.writeable = False
        return got

    def _outermost_by_name(self) -> np.ndarray:
        # one level up per round for the nodes still searched (compacted: no full-size pass)
        dup = np.zeros(len(self), dtype=bool)
        idx = np.nonzero(self.parent >= 0)[0]
        anc, code = self.parent[idx], self.code[idx]
        while len(idx):
            same = self.code[anc] == code
            dup[idx[same]] = True
            anc = self.parent[anc]
            keep = (anc >= 0) & ~same
            idx, anc, code = idx[keep], anc[keep], code[keep]
        return ~dup


def _nest(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Depth and parent of intervals sorted by (start, -end); improper overlaps are clipped.

    depth(i) = events started before i minus events ended by start(i); the parent is the last
    earlier event one level up. A child that outlives its parent is clipped and the nesting
    recomputed (the clock rounding of the profiler makes a few such events).
    """
    n = len(start)
    idx = np.arange(n, dtype=np.int64)
    end = end.copy()
    depth = np.zeros(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    for _ in range(_MAX_CLIP_ROUNDS):
        # stable sorts: the ends and the depths come in long sorted runs, which timsort merges
        # (4x faster than the default quicksort here; the sorted values are the same)
        depth = np.maximum(idx - np.searchsorted(np.sort(end, kind="stable"), start, side="right"), 0)
        by_depth = np.argsort(depth, kind="stable")
        sk = depth[by_depth] * n + by_depth  # the keys depth * n + idx, sorted
        pos = np.empty(n, dtype=np.int64)
        pos[by_depth] = np.searchsorted(sk, ((depth - 1) * n + idx)[by_depth])  # queries in order: faster
        pos -= 1
        cand = sk[np.maximum(pos, 0)]
        ok = (depth > 0) & (pos >= 0) & (cand // max(n, 1) == depth - 1)
        parent = np.where(ok, cand % max(n, 1), -1)
        pe = end[np.maximum(parent, 0)]
        # only a parent that contains the child's start may clip it; a parent that does not is
        # an artefact of an overlap earlier in time, which this round's clipping resolves
        bad = (parent >= 0) & (end > pe) & (start < pe)
        orphan = (parent >= 0) & (start >= pe)
        if not bad.any():
            parent[orphan] = -1
            break
        end[bad] = pe[bad]
    return depth, parent, end


def _timeline(start: np.ndarray, end: np.ndarray, depth: np.ndarray, parent: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments [s, e) with the innermost open node, from a nested set of intervals."""
    n = len(start)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    t = np.concatenate([start, end])
    is_start = np.concatenate([np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)])
    top_after = np.concatenate([np.arange(n), parent])
    # at equal times: ends before starts; deeper ends first; starts in tree order
    second = np.concatenate([np.arange(n), -depth])
    order = np.lexsort((second, is_start, t))
    t, top_after = t[order], top_after[order]
    seg_s, seg_e, top = t[:-1], t[1:], top_after[:-1]
    keep = seg_e > seg_s
    return seg_s[keep], seg_e[keep], top[keep]


def host_tree(rt: RankTrace) -> HostTree:
    """Build the host call trees of ``rt`` (cached on the rank object)."""
    cache = analysis_cache(rt)
    if "host_tree" in cache:
        return cache["host_tree"]
    kinds, rows, codes, tids, starts, ends = [], [], [], [], [], []
    labels: list[str] = []
    for kind, name in ((PYTHON, "python"), (OP, "ops"), (RUNTIME, "runtime"), (ANNOTATION, "annotations")):
        t = rt.table(name)
        if not len(t):
            continue
        keep = t["dur"] > 0
        if kind == ANNOTATION:
            keep &= ~t["gpu"] & ~t.strings("name").isin_labels(lambda s: s.startswith(_STEP_ANNOTATION))
        r = np.nonzero(keep)[0]
        s = t.strings("name")
        kinds.append(np.full(len(r), kind, dtype=np.int8))
        rows.append(r)
        codes.append(s.codes[r] + len(labels))
        labels.extend(s.labels)
        tids.append(t["tid"][r])
        starts.append(t["ts"][r])
        ends.append(t["ts"][r] + t["dur"][r])
    mt = main_tid(rt)
    if not sum(len(r) for r in rows):  # no host table, or no event with a duration
        z = np.zeros(0, dtype=np.int64)
        tree = HostTree(z.astype(np.int8), z, z, labels, z, z, z, z, z, mt, z, z, z,
                        np.full(len(rt.runtime), -1, dtype=np.int64))
        cache["host_tree"] = tree
        return tree
    kind = np.concatenate(kinds)
    row = np.concatenate(rows)
    code = np.concatenate(codes).astype(np.int64)
    tid = np.concatenate(tids)
    start = np.concatenate(starts)
    end = np.concatenate(ends)
    order = np.lexsort((-end, start, tid))
    kind, row, code, tid, start, end = kind[order], row[order], code[order], tid[order], start[order], end[order]
    depth = np.zeros(len(kind), dtype=np.int64)
    parent = np.full(len(kind), -1, dtype=np.int64)
    bounds = np.nonzero(np.diff(tid))[0] + 1
    lo_list = np.concatenate([[0], bounds])
    hi_list = np.concatenate([bounds, [len(tid)]])
    seg = (np.zeros(0, dtype=np.int64),) * 3
    for lo, hi in zip(lo_list, hi_list):
        d, p, e = _nest(start[lo:hi], end[lo:hi])
        depth[lo:hi] = d
        parent[lo:hi] = np.where(p >= 0, p + lo, -1)
        end[lo:hi] = e
        if tid[lo] == mt:
            s_, e_, t_ = _timeline(start[lo:hi], e, d, p)
            seg = (s_, e_, np.where(t_ >= 0, t_ + lo, -1))
    runtime_node = np.full(len(rt.runtime), -1, dtype=np.int64)
    rmask = kind == RUNTIME
    runtime_node[row[rmask]] = np.nonzero(rmask)[0]
    tree = HostTree(kind, row, code, labels, tid, start, end, depth, parent, mt, seg[0], seg[1], seg[2],
                    runtime_node)
    cache["host_tree"] = tree
    return tree


def gpu_busy(rt: RankTrace) -> Union:
    """Union of all GPU activity of the rank (kernels of any class, memcpy, memset)."""
    return gpu_unions(rt).all


def has_gpu(rt: RankTrace) -> bool:
    return bool(len(rt.kernels) or len(rt.memops))


def analysis_window(rt: RankTrace, steps: Steps) -> tuple[int, int]:
    """The analysed window: from the first step's start to the last step's end."""
    if len(steps):
        return int(steps.start.min()), int(steps.end.max())
    return window(rt)


def idle_ns(busy: Union, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """GPU idle time inside each window [a, b)."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    return np.maximum(b - a, 0) - busy.covered(a, b)


# ---------------------------------------------------------------- idle attribution
@dataclass
class Gaps:
    """Elementary segments of GPU idleness inside steps, each with the innermost main-thread
    host node (-1: no host event open) and whether the host was loading data."""

    start: np.ndarray
    end: np.ndarray
    node: np.ndarray
    step: np.ndarray  # step index (0..n-1)
    loading: np.ndarray  # bool

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.start


def _point_in(u: Union, t: np.ndarray) -> np.ndarray:
    if not len(u.start):
        return np.zeros(len(t), dtype=bool)
    i = np.searchsorted(u.start, t, side="right") - 1
    return (i >= 0) & (t < u.end[np.maximum(i, 0)])


def gpu_gaps(rt: RankTrace, steps: Steps, tree: HostTree | None = None, busy: Union | None = None) -> Gaps:
    """Cut every step's GPU-idle time into segments attributed to the host's innermost event.
    With the rank's own tree and GPU union (the default), cached on the rank by the steps'
    windows: the report, the class ratios and the step diff each ask for the same steps'."""
    tree = tree or host_tree(rt)
    busy = busy if busy is not None else gpu_busy(rt)
    if tree is not host_tree(rt) or busy is not gpu_busy(rt):
        return _gpu_gaps(rt, steps, tree, busy)
    key = ("gpu_gaps", steps.start.dtype.str, steps.start.tobytes(), steps.end.dtype.str, steps.end.tobytes())
    cache = analysis_cache(rt)
    if key not in cache:
        gaps = _gpu_gaps(rt, steps, tree, busy)
        for a in (gaps.start, gaps.end, gaps.node, gaps.step, gaps.loading):
            a.flags.writeable = False  # shared by every caller
        cache[key] = gaps
    return cache[key]


def _gpu_gaps(rt: RankTrace, steps: Steps, tree: HostTree, busy: Union) -> Gaps:
    load = loading_union(rt)
    if not len(steps):
        z = np.zeros(0, dtype=np.int64)
        return Gaps(z, z, z, z, z.astype(bool))
    lo, hi = int(steps.start.min()), int(steps.end.max())
    b = np.concatenate([tree.seg_start, tree.seg_end, busy.start, busy.end, load.start, load.end,
                        steps.start, steps.end])
    b = npx.unique_runs(b[(b >= lo) & (b <= hi)])  # sorted arrays end to end
    s, e = b[:-1], b[1:]
    step = steps.index_of(s)
    keep = (step >= 0) & ~_point_in(busy, s)
    s, e, step = s[keep], e[keep], step[keep]
    return Gaps(s, e, tree.innermost_at(s), step, _point_in(load, s))


# ---------------------------------------------------------------- hotspots
@dataclass
class Hotspot:
    """One Python function, op, annotation or runtime call, aggregated over all its calls."""

    kind: str  # python | op | annotation | runtime
    name: str
    calls: int
    inclusive_us: float  # host time, outermost calls only (recursion counted once)
    exclusive_us: float  # host time as the innermost event (main thread)
    gpu_us: float  # GPU time of the kernels/copies launched inside it
    idle_us: float  # host time inside it while the GPU was idle (inclusive, outermost calls)
    bottleneck_ratio: float  # idle_us / window duration
    site: str = ""  # user frame of its largest call (for ops / runtime calls)


@dataclass
class ClassRatio:
    """Bottleneck ratio of one class of activity."""

    cls: str
    time_us: float
    ratio: float


@dataclass
class Hotspots:
    window_us: float
    gpu_idle_us: float
    items: list[Hotspot]
    classes: list[ClassRatio]
    has_gpu: bool


def launched_gpu_ns(rt: RankTrace, tree: HostTree) -> np.ndarray:
    """GPU time launched by each node, inclusive of its descendants."""
    self_ns = np.zeros(len(tree), dtype=np.int64)
    for name in ("kernels", "memops"):
        g = rt.table(name)
        if not len(g) or not len(tree):
            continue
        lr = launch_rows(rt.runtime, g)
        ok = lr >= 0
        nodes = tree.runtime_node[lr[ok]]
        good = nodes >= 0
        np.add.at(self_ns, nodes[good], g["dur"][ok][good])
    return _inclusive(tree, self_ns)


def _inclusive(tree: HostTree, values: np.ndarray) -> np.ndarray:
    """Sum ``values`` of every node into all its ancestors, deepest level first."""
    out = values.astype(np.int64).copy()
    if not len(tree):
        return out
    order = np.argsort(-tree.depth, kind="stable")
    d_sorted = -tree.depth[order]
    cuts = np.nonzero(np.diff(d_sorted))[0] + 1
    for part in np.split(order, cuts):
        p = tree.parent[part]
        ok = p >= 0
        np.add.at(out, p[ok], out[part[ok]])
    return out


def hotspots(rt: RankTrace, steps: Steps | None = None, top: int = 30, items: bool = True) -> Hotspots:
    """Per host item: calls, inclusive/exclusive time, launched GPU time, bottleneck ratio;
    and the bottleneck ratio of each class of activity. Sorted by bottleneck ratio, then time.
    ``items`` False: the classes only (what the diagnosis and the cross-rank comparison read)."""
    steps = steps if steps is not None else find_steps(rt)
    tree = host_tree(rt)
    lo, hi = analysis_window(rt, steps)
    a_s, b_s = _windows(rt, steps)
    win = max(int((b_s - a_s).sum()), 1)
    gpu = has_gpu(rt)
    u = gpu_unions(rt)
    busy = u.all
    out: list[Hotspot] = []
    if items and len(tree):
        outer = tree.outermost_by_name()
        excl = tree.exclusive_ns()
        gpu_ns = launched_gpu_ns(rt, tree)
        a, b = np.clip(tree.start, lo, hi), np.clip(tree.end, lo, hi)
        idle = idle_ns(busy, a, b) if gpu else np.zeros(len(tree), dtype=np.int64)
        n_codes = len(tree.labels)
        calls = np.bincount(tree.code, minlength=n_codes)
        incl = np.bincount(tree.code[outer], weights=(tree.end - tree.start)[outer], minlength=n_codes)
        exc = np.bincount(tree.code, weights=excl, minlength=n_codes)
        g = np.bincount(tree.code[outer], weights=gpu_ns[outer], minlength=n_codes)
        idl = np.bincount(tree.code[outer], weights=idle[outer], minlength=n_codes)
        kind_of = np.zeros(n_codes, dtype=np.int8)
        kind_of[tree.code] = tree.kind
        # rank by what the GPU waited on, then by host time
        order = np.lexsort((-incl, -idl))
        for c in order[:top]:
            if calls[c] == 0:
                continue
            out.append(Hotspot(
                kind=KIND_NAMES[kind_of[c]], name=tree.labels[c], calls=int(calls[c]),
                inclusive_us=float(incl[c]) / NS_PER_US, exclusive_us=float(exc[c]) / NS_PER_US,
                gpu_us=float(g[c]) / NS_PER_US, idle_us=float(idl[c]) / NS_PER_US,
                bottleneck_ratio=float(idl[c]) / win,
            ))
    classes = class_ratios(rt, steps, tree) if gpu else []
    gpu_idle = float(idle_ns(busy, a_s, b_s).sum()) if gpu else 0.0
    return Hotspots(window_us=win / NS_PER_US, gpu_idle_us=gpu_idle / NS_PER_US, items=out,
                    classes=classes, has_gpu=gpu)


def _class_of_nodes(tree: HostTree) -> np.ndarray:
    """Host class of each node, as an index into HOST_CLASSES."""
    is_sync = np.array([classify.is_sync_call(s) for s in tree.labels] + [False], dtype=bool)
    cls = np.zeros(len(tree), dtype=np.int64)  # python
    cls[tree.kind == OP] = 1
    cls[tree.kind == ANNOTATION] = 1
    rtm = tree.kind == RUNTIME
    cls[rtm] = 2
    cls[rtm & is_sync[tree.code]] = 3
    return cls


HOST_CLASSES = ("host: python", "host: op dispatch", "host: cuda runtime", "host: cuda sync",
                "host: no traced event", "host: data loading")


def _windows(rt: RankTrace, steps: Steps) -> tuple[np.ndarray, np.ndarray]:
    """Step windows (or the whole trace as one window when there are no steps)."""
    if len(steps):
        return steps.start.astype(np.int64), steps.end.astype(np.int64)
    lo, hi = window(rt)
    return np.array([lo], dtype=np.int64), np.array([hi], dtype=np.int64)


def class_ratios(rt: RankTrace, steps: Steps, tree: HostTree) -> list[ClassRatio]:
    """Bottleneck ratio per class over the step windows (definitions in docs/metrics.md).

    GPU classes: compute time; memory-op time not overlapped by compute; communication time of
    each collective type not overlapped by compute. Host classes split the GPU-idle time by the
    main thread's innermost event (data loading first).
    """
    lo, hi = _windows(rt, steps)
    win = max(int((hi - lo).sum()), 1)
    u = gpu_unions(rt)
    out: list[ClassRatio] = []
    comp = int(u.compute.covered(lo, hi).sum())
    out.append(ClassRatio("gpu: compute", comp / NS_PER_US, comp / win))
    mem = int(union_of(u.compute, u.memory).covered(lo, hi).sum()) - comp
    out.append(ClassRatio("gpu: memory ops", mem / NS_PER_US, mem / win))
    for t, (_calls, _total, exposed) in exposed_by_type(rt, u, lo, hi).items():
        out.append(ClassRatio(f"gpu: communication {t}", exposed / NS_PER_US, exposed / win))
    if len(steps):
        gaps = gpu_gaps(rt, steps, tree, u.all)
        d = gaps.dur
        cls = np.full(len(d), 4, dtype=np.int64)
        has = gaps.node >= 0
        if len(tree):
            cls[has] = _class_of_nodes(tree)[gaps.node[has]]
        cls[gaps.loading] = 5
        sums = np.bincount(cls, weights=d, minlength=len(HOST_CLASSES))
        for i, name in enumerate(HOST_CLASSES):
            out.append(ClassRatio(name, float(sums[i]) / NS_PER_US, float(sums[i]) / win))
    return out
