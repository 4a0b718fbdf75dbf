"""Links between the UI's tables: a Python function or op -> the ops and kernels under it, and
a kernel -> the ops and Python functions that launched it. Pure functions over the host call
tree (:func:`aiprof.analysis.hotspots.host_tree`) and the launch join (``corr``)."""
from __future__ import annotations

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import OP, PYTHON, host_tree
from aiprof.analysis.launch import launch_rows
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
_KIND = {"python": PYTHON, "op": OP}


def _under(tree, roots: np.ndarray) -> np.ndarray:
    """Boolean mask of nodes that are, or descend from, a node in ``roots`` (vectorised walk)."""
    mark = np.zeros(len(tree), dtype=bool)
    mark[roots] = True
    cur = tree.parent.copy()
    hit = mark.copy()
    active = (cur >= 0) & ~hit
    while active.any():
        idx = np.nonzero(active)[0]
        hit[idx] |= mark[cur[idx]]
        nxt = tree.parent[cur[idx]]
        cur[idx] = nxt
        active[idx] = (nxt >= 0) & ~hit[idx]
    return hit


def _group(names: list[str], codes: np.ndarray, dur: np.ndarray, limit: int) -> list[dict]:
    if not len(codes):
        return []
    n = len(names)
    cnt = np.bincount(codes, minlength=n)
    tot = np.bincount(codes, weights=dur, minlength=n)
    return [{"name": names[c], "calls": int(cnt[c]), "total_us": float(tot[c]) / NS_PER_US}
            for c in np.argsort(-tot)[:limit] if cnt[c]]


def _kernel_nodes(rt: RankTrace, tree) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(tree node of the launch, duration, name code, labels) of every kernel with a known launch."""
    k = rt.kernels
    if not len(k) or not len(tree):
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), []
    lr = launch_rows(rt.runtime, k)
    ok = lr >= 0
    node = np.full(len(k), -1, np.int64)
    node[ok] = tree.runtime_node[lr[ok]]
    names = k.strings("name")
    return node, k["dur"], names.codes, names.labels


def under(rt: RankTrace, kind: str, name: str, limit: int = 200) -> dict:
    """Ops (host time, outermost calls counted) and kernels (GPU time) under every call of the
    Python function or op ``name`` (``kind`` is "python" or "op")."""
    tree = host_tree(rt)
    if kind not in _KIND:
        raise ValueError(f"kind must be python or op, not {kind!r}")
    codes = [i for i, s in enumerate(tree.labels) if s == name]
    roots = np.nonzero(np.isin(tree.code, codes) & (tree.kind == _KIND[kind]))[0] if codes else np.zeros(0, np.int64)
    if not len(roots):
        return {"kind": kind, "name": name, "calls": 0, "ops": [], "kernels": []}
    inside = _under(tree, roots)
    ops = inside & (tree.kind == OP)
    if kind == "op":
        ops[roots] = False
    # an op nested in an op of the same name would count twice: keep the outermost
    ops &= tree.outermost_by_name()
    node, dur, kcodes, klabels = _kernel_nodes(rt, tree)
    kin = (node >= 0) & npx.take(inside, node, False)
    return {"kind": kind, "name": name, "calls": int(len(roots)),
            "ops": _group(tree.labels, tree.code[ops], (tree.end - tree.start)[ops], limit),
            "kernels": _group(klabels, kcodes[kin], dur[kin], limit)}


def launchers(rt: RankTrace, kernel: str, limit: int = 200) -> dict:
    """The innermost op and the nearest Python frame that launched each call of ``kernel``,
    grouped by name, weighted by the kernel's GPU time."""
    tree = host_tree(rt)
    node, dur, kcodes, klabels = _kernel_nodes(rt, tree)
    want = [i for i, s in enumerate(klabels) if s == kernel]
    sel = np.isin(kcodes, want) & (node >= 0)
    out = {"name": kernel, "calls": int(np.isin(kcodes, want).sum()), "ops": [], "python": []}
    if not sel.any():
        return out
    for key, kd in (("ops", OP), ("python", PYTHON)):
        near = tree.nearest(node[sel], kd)
        ok = near >= 0
        out[key] = _group(tree.labels, tree.code[near[ok]], dur[sel][ok], limit)
    return out
