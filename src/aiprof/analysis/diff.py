"""Step diff: why is one step slower than another? Definitions in docs/metrics.md ("Step diff").

A step's time is split into *root items* that add up to it (up to overlapping GPU work):

* ``kernel`` / ``memop`` items: GPU time of each kernel name / copy kind that started in the step;
* ``gap`` items: GPU-idle time in the step, attributed to the innermost host event of the main
  thread at that instant (a Python frame, an op, a runtime call), or to "no host event".

The diff of two steps is the per-item difference; items are ranked by their contribution to
the step-time difference. Host items (Python functions and ops, inclusive time and calls) are
listed beside, as context for the gaps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import (
    KIND_NAMES,
    OP,
    PYTHON,
    gpu_busy,
    gpu_gaps,
    host_tree,
)
from aiprof.analysis.steps import Steps, find_steps
from aiprof.errors import UsageError
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
NO_HOST = "(no host event)"
# Python builtins are named with their object's address ("... object at 0x7f3a..."), which
# differs between processes: dropped so that two captures' items match.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def item_name(name: str) -> str:
    """The name an item is matched by across steps and captures."""
    return _ADDRESS.sub("", name) if " at 0x" in name else name  # the test: a fraction of the regex's cost


@dataclass
class Item:
    kind: str  # kernel | memop | gap
    name: str  # kernel name, copy kind, or for gaps the host event's name
    time_ns: int
    calls: int
    host_kind: str = ""  # gaps: python | op | runtime | annotation | ""
    stack: list[str] = field(default_factory=list)  # gaps: Python frames, outermost first
    site: str = ""  # gaps: nearest user frame


@dataclass
class StepProfile:
    source: str
    rank: int
    step: int
    duration_ns: int
    items: dict[tuple[str, str], Item]
    host: dict[tuple[str, str], tuple[int, int]]  # (kind, name) -> (inclusive ns, calls)


@dataclass
class DiffItem:
    kind: str
    name: str
    delta_us: float
    base_us: float
    compare_us: float
    delta_calls: int
    base_calls: int
    compare_calls: int
    delta_share_pp: float  # share of step time, compare minus base, in percentage points
    host_kind: str = ""
    stack: list[str] = field(default_factory=list)
    site: str = ""


@dataclass
class StepDiff:
    base: dict
    compare: dict
    delta_us: float
    items: list[DiffItem]
    residual_us: float  # delta not explained by the items (overlapping GPU work)
    host_items: list[DiffItem]


def step_profiles(rt: RankTrace, steps: Steps | None = None, which: list[int] | None = None) -> list[StepProfile]:
    """Root items of each step (or of the step indices in ``which``)."""
    steps = steps if steps is not None else find_steps(rt)
    which = list(range(len(steps))) if which is None else which
    tree = host_tree(rt)
    busy = gpu_busy(rt)
    gaps = gpu_gaps(rt, steps, tree, busy)
    profs = {i: StepProfile(rt.source, rt.rank, int(steps.number[i]), int(steps.end[i] - steps.start[i]), {}, {})
             for i in which}
    wanted = np.zeros(len(steps), dtype=bool)
    wanted[which] = True
    # GPU items: by start time in the step
    for tname, kind in (("kernels", "kernel"), ("memops", "memop")):
        g = rt.table(tname)
        if not len(g):
            continue
        idx = steps.index_of(g["ts"])
        ok = idx >= 0
        ok[ok] = wanted[idx[ok]]
        names = g.strings("name")
        n = len(names.labels)
        key = idx[ok] * n + names.codes[ok]
        uk, inv = npx.unique(key, return_inverse=True)
        t = np.bincount(inv, weights=g["dur"][ok])
        c = np.bincount(inv)
        for k, tt, cc in zip(uk.tolist(), t.tolist(), c.tolist()):  # lists: no numpy scalar per item
            profs[k // n].items[(kind, names.labels[k % n])] = Item(kind, names.labels[k % n], int(tt), int(cc))
    # gaps: by innermost host node's name
    labels = tree.labels + [NO_HOST]
    nl = len(labels)
    has = gaps.node >= 0
    code = np.where(has, tree.code[np.maximum(gaps.node, 0)] if len(tree) else 0, nl - 1)
    sel = wanted[gaps.step] if len(gaps.step) else np.zeros(0, dtype=bool)
    key = gaps.step[sel] * nl + code[sel]
    if len(key):
        uk, inv = npx.unique(key, return_inverse=True)
        t = np.bincount(inv, weights=gaps.dur[sel])
        # representative node (largest gap segment) of each item, for its stack
        order = np.lexsort((-gaps.dur[sel], inv))
        first = order[np.concatenate([[0], np.nonzero(np.diff(inv[order]))[0] + 1])]
        rep = gaps.node[sel][first]
        calls = _calls_per_step(tree, steps, wanted)
        for k, tt, r in zip(uk.tolist(), t.tolist(), rep.tolist()):
            s, cd = k // nl, k % nl
            name = item_name(labels[cd])
            hk = KIND_NAMES[tree.kind[r]] if r >= 0 else ""
            stack = tree.stack(r) if r >= 0 else []
            site = tree.user_site(r) if r >= 0 else ""
            prev = profs[s].items.get(("gap", name))
            if prev is not None:  # two labels that differ only by an address
                prev.time_ns += int(tt)
                prev.calls += calls.get((s, cd), 0)
                continue
            profs[s].items[("gap", name)] = Item("gap", name, int(tt), calls.get((s, cd), 0), hk, stack, site)
    # host items: Python functions and ops, inclusive time of outermost calls, calls
    if len(tree):
        outer = tree.outermost_by_name()
        sidx = steps.index_of(tree.start)
        m = (sidx >= 0) & ((tree.kind == PYTHON) | (tree.kind == OP))
        m[m] = wanted[sidx[m]]
        key = sidx[m] * len(tree.labels) + tree.code[m]
        uk, inv = npx.unique(key, return_inverse=True)
        incl = np.bincount(inv, weights=np.where(outer[m], (tree.end - tree.start)[m], 0))
        cnt = np.bincount(inv)
        kind_of = np.zeros(len(tree.labels), dtype=np.int8)
        kind_of[tree.code] = tree.kind
        kinds = kind_of.tolist()
        host_key: dict[int, tuple[str, str]] = {}  # by label code: the steps share their labels
        for k, ii, cc in zip(uk.tolist(), incl.tolist(), cnt.tolist()):
            s, cd = k // len(tree.labels), k % len(tree.labels)
            key2 = host_key.get(cd)
            if key2 is None:
                key2 = host_key[cd] = (KIND_NAMES[kinds[cd]], item_name(tree.labels[cd]))
            pi, pc = profs[s].host.get(key2, (0, 0))
            profs[s].host[key2] = (pi + int(ii), pc + int(cc))
    return [profs[i] for i in which]


def _calls_per_step(tree, steps: Steps, wanted: np.ndarray) -> dict[tuple[int, int], int]:
    """Calls per (step index, label code), of the ``wanted`` steps only (a diff reads two)."""
    if not len(tree):
        return {}
    sidx = steps.index_of(tree.start)
    ok = sidx >= 0
    ok[ok] = wanted[sidx[ok]]
    n = len(tree.labels) + 1
    uk, cnt = npx.unique(sidx[ok] * n + tree.code[ok], return_counts=True)
    return {(int(k // n), int(k % n)): int(c) for k, c in zip(uk, cnt)}


def median_and_slowest(steps: Steps) -> tuple[int, int]:
    """Indices of the median step (closest to the median duration) and of the slowest."""
    d = steps.end - steps.start
    med = int(np.argmin(np.abs(d - np.median(d))))
    return med, int(np.argmax(d))


def step_index(steps: Steps, number: int) -> int:
    """Index of the step numbered ``number``; a UsageError naming the valid ones otherwise."""
    hit = np.nonzero(steps.number == number)[0]
    if not len(hit):
        raise UsageError(f"no step {number} in the trace (steps: {', '.join(str(int(n)) for n in steps.number)})")
    return int(hit[0])


def diff_profiles(base: StepProfile, cmp: StepProfile, top: int = 25) -> StepDiff:
    """Per-item difference of two step profiles, ranked by contribution to the time difference."""
    delta = cmp.duration_ns - base.duration_ns
    sign = 1 if delta >= 0 else -1
    bd, cd = max(base.duration_ns, 1), max(cmp.duration_ns, 1)
    items = []
    for key in sorted(set(base.items) | set(cmp.items)):  # sorted: the same report under any hash seed
        b, c = base.items.get(key), cmp.items.get(key)
        bt, ct = (b.time_ns if b else 0), (c.time_ns if c else 0)
        bc, cc = (b.calls if b else 0), (c.calls if c else 0)
        ref = c or b
        items.append(DiffItem(kind=key[0], name=key[1], delta_us=(ct - bt) / NS_PER_US, base_us=bt / NS_PER_US,
                              compare_us=ct / NS_PER_US, delta_calls=cc - bc, base_calls=bc, compare_calls=cc,
                              delta_share_pp=100.0 * (ct / cd - bt / bd), host_kind=ref.host_kind,
                              stack=ref.stack, site=ref.site))
    explained = sum(i.delta_us for i in items)
    items.sort(key=lambda i: -sign * i.delta_us)
    host = []
    for key in sorted(set(base.host) | set(cmp.host)):
        bt, bc = base.host.get(key, (0, 0))
        ct, cc = cmp.host.get(key, (0, 0))
        host.append(DiffItem(kind=key[0], name=key[1], delta_us=(ct - bt) / NS_PER_US, base_us=bt / NS_PER_US,
                             compare_us=ct / NS_PER_US, delta_calls=cc - bc, base_calls=bc, compare_calls=cc,
                             delta_share_pp=100.0 * (ct / cd - bt / bd)))
    host.sort(key=lambda i: -sign * i.delta_us)
    return StepDiff(
        base={"source": base.source, "rank": base.rank, "step": base.step, "duration_us": base.duration_ns / NS_PER_US},
        compare={"source": cmp.source, "rank": cmp.rank, "step": cmp.step, "duration_us": cmp.duration_ns / NS_PER_US},
        delta_us=delta / NS_PER_US, items=items[:top], residual_us=delta / NS_PER_US - explained,
        host_items=host[:top])


def diff_steps(rt: RankTrace, base: int | None = None, compare: int | None = None,
               steps: Steps | None = None, top: int = 25) -> StepDiff:
    """Diff two steps of one rank (step numbers; defaults: median vs slowest)."""
    steps = steps if steps is not None else find_steps(rt)
    med, slow = median_and_slowest(steps)
    bi = med if base is None else step_index(steps, base)
    ci = slow if compare is None else step_index(steps, compare)
    pb, pc = step_profiles(rt, steps, [bi, ci]) if bi != ci else step_profiles(rt, steps, [bi]) * 2
    return diff_profiles(pb, pc, top)


def diff_captures(a: RankTrace, b: RankTrace, base: int | None = None, compare: int | None = None,
                  top: int = 25) -> StepDiff:
    """Diff a step of capture A (default: its median step) against one of B (default: median)."""
    sa, sb = find_steps(a), find_steps(b)
    bi = median_and_slowest(sa)[0] if base is None else step_index(sa, base)
    ci = median_and_slowest(sb)[0] if compare is None else step_index(sb, compare)
    return diff_profiles(step_profiles(a, sa, [bi])[0], step_profiles(b, sb, [ci])[0], top)
