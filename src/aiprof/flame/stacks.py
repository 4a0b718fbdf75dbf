"""Build AI flame-graph stacks from a rank's tables: Python → torch op → CUDA call → GPU kernel.

How a GPU event gets its stack (no name guessing anywhere):

1. The GPU row (kernel, memcpy, memset) is joined to the CUDA runtime/driver call that
   launched it by **correlation id** (:func:`aiprof.analysis.launch.launch_rows`).
2. That call is a node of its host thread's **interval forest**: every host interval of the
   thread (``python_function`` frames, ``cpu_op`` torch ops, host ``user_annotation`` ranges,
   runtime calls) is nested by **timestamps** (:mod:`aiprof.analysis.nesting`), so the call's
   ancestors are the Python frames and ops that were on that thread's stack when it ran.
3. A thread with no Python frames (autograd's backward worker) has its root intervals linked
   to the innermost interval of the Python thread of the same process at that instant (the
   main thread sits in ``loss.backward()`` while the worker launches backward kernels).

The host-only ("CPU") graph weighs every interval of the same forest by its exclusive time:
its duration minus its same-thread children's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from aiprof import npx
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.steps import Steps, find_steps
from aiprof.errors import UsageError
from aiprof.analysis.nesting import Nesting, nest
from aiprof.flame.profile import GPU_PREFIX, Profile, Stack, merge
from aiprof.trace.store import Capture, RankTrace
from aiprof.trace.table import Table, concat

# Order of host sources; the index doubles as the tie-break for identical bounds (outer first).
_SOURCES = ("python", "annotations", "ops", "runtime")
_STEP_ANNOTATION = re.compile(r"^ProfilerStep#\d+$")
# "<built-in method foo of X object at 0x7f..>": the address differs per object and would split
# identical frames, so it is dropped (once per distinct label).
_ADDRESS = re.compile(r" of (?:[^<>]*?) object at 0x[0-9a-fA-F]+>$")
NO_LAUNCH = "[launch not in trace]"


def frame_label(source: str, name: str) -> str:
    """The frame text for a host event's name (Python frames lose object addresses)."""
    if source == "python" and name.startswith("<built-in"):
        return _ADDRESS.sub(">", name)
    return name


@dataclass
class HostForest:
    """All host intervals of one rank as one forest, and a trie of their distinct stacks.

    Row ``i`` (concatenation of the sources in ``_SOURCES`` order; ``offset[src]`` is each
    source's first row) has bounds ``start/end`` (ns, nesting-repaired), its thread ``tid``,
    its ``parent`` row (-1 for roots; possibly on another thread when ``linked``), and
    ``node``: its stack in the trie (``trie_parent``/``trie_label``, node 0 = empty stack).
    """

    labels: list[str]
    start: np.ndarray
    end: np.ndarray
    tid: np.ndarray
    parent: np.ndarray
    linked: np.ndarray
    node: np.ndarray
    trie_parent: np.ndarray
    trie_label: np.ndarray
    offset: dict[str, int]
    repaired: int
    links: int

    def path(self, node: int) -> Stack:
        """The stack (root first) of a trie node."""
        memo = self._memo
        out = memo.get(node)
        if out is None:
            chain = []
            n = node
            while n > 0 and n not in memo:
                chain.append(n)
                n = int(self.trie_parent[n])
            out = memo.get(n, ()) if n > 0 else ()
            for c in reversed(chain):
                out = out + (self.labels[int(self.trie_label[c])],)
                memo[c] = out
        return out

    def __post_init__(self) -> None:
        self._memo: dict[int, Stack] = {}


def _host_rows(rt: RankTrace) -> tuple[Table, dict[str, int], list[str]]:
    """Concatenate the host sources into one table with global label codes and a source code."""
    labels: dict[str, int] = {}
    parts, offset, n = [], {}, 0
    for si, src in enumerate(_SOURCES):
        t = rt.table(src)
        offset[src] = n
        if not len(t):
            continue
        names = t.strings("name")
        remap = np.array([labels.setdefault(frame_label(src, s), len(labels)) for s in names.labels]
                         + [labels.setdefault("", len(labels))], dtype=np.int64)
        code = remap[names.codes]
        keep = np.ones(len(t), dtype=bool)
        if src == "annotations":
            # GPU-side annotations are not host frames; step markers would split every tower by step
            keep = ~t["gpu"] & ~names.isin_labels(lambda s: bool(_STEP_ANNOTATION.match(s)))
        if src == "runtime":
            assert keep.all()  # runtime rows must stay aligned with the table (launch_rows indexes it)
        parts.append(Table({"ts": t["ts"][keep], "dur": t["dur"][keep], "pid": t["pid"][keep],
                            "tid": t["tid"][keep], "label": code[keep],
                            "src": np.full(int(keep.sum()), si, dtype=np.int64)}))
        n += int(keep.sum())
    return concat(parts), offset, list(labels)


def host_forest(rt: RankTrace) -> HostForest:
    """Nest every host interval of ``rt`` and intern the resulting stacks (O(n log n))."""
    rows, offset, labels = _host_rows(rt)
    n = len(rows)
    start = rows["ts"].astype(np.int64) if n else np.zeros(0, np.int64)
    end = (rows["ts"] + rows["dur"]).astype(np.int64) if n else np.zeros(0, np.int64)
    pid = rows["pid"] if n else np.zeros(0, np.int64)
    tid = rows["tid"] if n else np.zeros(0, np.int64)
    src = rows["src"] if n else np.zeros(0, np.int64)
    label = rows["label"] if n else np.zeros(0, np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    new_end = end.copy()
    repaired = 0
    threads: dict[tuple[int, int], tuple[np.ndarray, Nesting]] = {}
    if n:
        upid, utid, inv = npx.unique_pairs(pid, tid)
        by_thread = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[by_thread], np.arange(len(upid) + 1))
        for k in range(len(upid)):
            idx = by_thread[bounds[k]:bounds[k + 1]]
            ns = nest(start[idx], end[idx], src[idx])
            g = idx[ns.order]  # sorted position -> global row
            has = ns.parent >= 0
            parent[g[has]] = g[ns.parent[has]]
            depth[g] = ns.depth
            new_end[g] = ns.end
            repaired += ns.repaired
            threads[(int(upid[k]), int(utid[k]))] = (g, ns)
    linked = np.zeros(n, dtype=bool)
    links = _link_threads(threads, src, parent, linked)
    node, trie_parent, trie_label = _intern(parent, linked, depth, label, len(labels))
    return HostForest(labels, start, new_end, tid, parent, linked, node, trie_parent, trie_label,
                      offset, repaired, links)


def _link_threads(threads: dict[tuple[int, int], tuple[np.ndarray, Nesting]], src: np.ndarray,
                  parent: np.ndarray, linked: np.ndarray) -> int:
    """Hang the roots of Python-less threads under the Python thread active at that instant."""
    py = _SOURCES.index("python")
    with_py = {k for k, (g, _) in threads.items() if (src[g] == py).any()}
    links = 0
    for key, (g, ns) in threads.items():
        if key in with_py:
            continue
        roots = np.nonzero(ns.parent < 0)[0]
        for other in sorted(k for k in with_py if k[0] == key[0]):
            og, ons = threads[other]
            free = parent[g[roots]] < 0
            if not free.any():
                break
            r = roots[free]
            hit = ons.innermost_at(ns.start[r])
            ok = hit >= 0
            parent[g[r[ok]]] = og[hit[ok]]
            linked[g[r[ok]]] = True
            links += int(ok.sum())
    return links


def _intern(parent: np.ndarray, linked: np.ndarray, local_depth: np.ndarray, label: np.ndarray,
            n_labels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trie node of every row, built level by level (one ``np.unique`` per depth)."""
    n = len(parent)
    node = np.zeros(n, dtype=np.int64)
    if not n:
        return node, np.zeros(1, np.int64), np.zeros(1, np.int64)
    # global depth: linked subtrees start below their cross-thread parent (whose thread is
    # never itself linked, so its local depth is global)
    # pointer jumping over same-thread parents only, to find each row's local root
    local = np.where((parent >= 0) & ~linked, parent, np.arange(n))
    while True:
        nxt = local[local]
        if np.array_equal(nxt, local):
            break
        local = nxt
    shift = np.zeros(n, dtype=np.int64)
    lr = local
    is_link = linked[lr]
    shift[is_link] = local_depth[parent[lr[is_link]]] + 1
    depth = local_depth + shift
    trie_parent: list[int] = [0]
    trie_label: list[int] = [-1]
    index: dict[int, int] = {}
    order = np.argsort(depth, kind="stable")
    cuts = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
    for d in range(len(cuts) - 1):
        rows = order[cuts[d]:cuts[d + 1]]
        if not len(rows):
            continue
        p = parent[rows]
        pnode = np.where(p >= 0, node[np.maximum(p, 0)], 0)
        key = pnode * (n_labels + 1) + label[rows]
        uk, inv = npx.unique(key, return_inverse=True)
        ids = np.empty(len(uk), dtype=np.int64)
        for j, kk in enumerate(uk.tolist()):
            t = index.get(kk)
            if t is None:
                t = index[kk] = len(trie_parent)
                trie_parent.append(kk // (n_labels + 1))
                trie_label.append(kk % (n_labels + 1))
            ids[j] = t
        node[rows] = ids[inv.ravel()]
    return node, np.array(trie_parent, dtype=np.int64), np.array(trie_label, dtype=np.int64)


# --- profiles ---------------------------------------------------------------------------------

def _gpu_rows(rt: RankTrace) -> Table:
    """Kernels and memcpy/memset rows as one table (name, ts, dur, corr)."""
    parts = []
    for name in ("kernels", "memops"):
        t = rt.table(name)
        if len(t):
            parts.append(Table({"ts": t["ts"], "dur": t["dur"], "corr": t["corr"], "name": t.strings("name")}))
    return concat(parts)


def _select_step(rt: RankTrace, step: Optional[int], steps: Optional[Steps]) -> Optional[tuple[int, int]]:
    if step is None:
        return None
    st = steps if steps is not None else find_steps(rt)
    hit = np.nonzero(st.number == step)[0]
    if not len(hit):
        raise UsageError(f"rank {rt.rank} has no step {step} (steps: {', '.join(map(str, st.number.tolist()))})")
    return int(st.start[hit[0]]), int(st.end[hit[0]])


def gpu_profile(rt: RankTrace, step: Optional[int] = None, forest: Optional[HostForest] = None,
                steps: Optional[Steps] = None) -> Profile:
    """GPU flame graph of one rank: every kernel/memcpy/memset weighted by its GPU duration (ns).

    With ``step``, only GPU work *launched* during that step's host window (by the launching
    call's timestamp; the GPU start when the launch is not in the trace) is counted.
    """
    fo = forest if forest is not None else host_forest(rt)
    g = _gpu_rows(rt)
    name = f"GPU rank {rt.rank}" + ("" if step is None else f" step {step}")
    if not len(g):
        return Profile(name, [], np.zeros(0, np.int64))
    lr = launch_rows(rt.runtime, g)
    row = np.where(lr >= 0, fo.offset["runtime"] + lr, -1)
    node = npx.take(fo.node, row, -1)
    win = _select_step(rt, step, steps)
    if win is not None:
        t = np.where(row >= 0, npx.take(fo.start, row, 0), g["ts"])
        keep = (t >= win[0]) & (t < win[1])
        node, g = node[keep], g.take(keep)
    names = g.strings("name")
    key = (node + 1) * (len(names.labels) + 1) + names.codes
    uk, inv = npx.unique(key, return_inverse=True)
    w = _sum_by(inv.ravel(), g["dur"], len(uk))
    stacks: list[Stack] = []
    for k in uk.tolist():
        nd, lab = divmod(k, len(names.labels) + 1)
        nd -= 1
        head = fo.path(nd) if nd >= 0 else (NO_LAUNCH,)
        stacks.append(head + (GPU_PREFIX + names.labels[lab],))
    return Profile(name, stacks, w, meta={"rank": rt.rank, "what": "gpu", "step": step})


def cpu_profile(rt: RankTrace, step: Optional[int] = None, forest: Optional[HostForest] = None,
                steps: Optional[Steps] = None) -> Profile:
    """Host ("CPU") flame graph of one rank: every host interval weighted by exclusive time (ns).

    Exclusive time = the interval's duration minus its same-thread children's (time in a
    thread linked below it is that thread's own). With ``step``, intervals are clipped to the
    step's window first, so the weights add up to the host time inside it.
    """
    fo = forest if forest is not None else host_forest(rt)
    name = f"CPU rank {rt.rank}" + ("" if step is None else f" step {step}")
    if not len(fo.start):
        return Profile(name, [], np.zeros(0, np.int64))
    s, e = fo.start, fo.end
    win = _select_step(rt, step, steps)
    if win is not None:
        s, e = np.clip(s, win[0], win[1]), np.clip(e, win[0], win[1])
    length = np.maximum(e - s, 0)
    child = (fo.parent >= 0) & ~fo.linked
    excl = length - _sum_by(fo.parent[child], length[child], len(length))
    w = _sum_by(fo.node, excl, len(fo.trie_parent))
    nodes = np.nonzero(w > 0)[0]
    return Profile(name, [fo.path(int(k)) for k in nodes], w[nodes], meta={"rank": rt.rank, "what": "cpu", "step": step})


def _sum_by(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Exact int64 group sums (``np.bincount`` would go through float64)."""
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, index, values.astype(np.int64))
    return out


def build(capture: Capture, what: str = "gpu", rank: Optional[int] = None, step: Optional[int] = None,
          split_ranks: bool = False) -> Profile:
    """The flame graph of a capture: one rank, or all ranks merged (``split_ranks``: one root per rank).

    ``what`` is "gpu" or "cpu"; ``step`` is a step number as in the report (e.g. 3 for
    ``ProfilerStep#3``).
    """
    if what not in ("gpu", "cpu"):
        raise UsageError(f"--what must be gpu or cpu, not {what!r}")
    ranks = capture.ranks
    if rank is not None:
        try:
            ranks = [capture.rank(rank)]
        except KeyError:
            raise UsageError(f"no rank {rank} in this capture (ranks: {', '.join(str(r.rank) for r in capture.ranks)})") from None
    fn = gpu_profile if what == "gpu" else cpu_profile
    profs = []
    for rt in ranks:
        p = fn(rt, step=step)
        profs.append(p.prefixed(f"rank {rt.rank}") if split_ranks else p)
    if len(profs) == 1:
        return profs[0]
    label = "GPU" if what == "gpu" else "CPU"
    out = merge(profs, name=f"{label} ranks {','.join(str(r.rank) for r in ranks)}" + ("" if step is None else f" step {step}"))
    out.meta = {"what": what, "step": step, "ranks": [r.rank for r in ranks]}
    return out
