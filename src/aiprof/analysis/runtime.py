"""CUDA runtime/driver analysis: per-call statistics, synchronisations and their sites, launch
delay. Definitions in docs/metrics.md ("Runtime")."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import OP, PYTHON, gpu_busy, has_gpu, host_tree, idle_ns
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.steps import Steps, find_steps
from aiprof.trace import classify
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
# Ops whose sync is the `.item()` / `.tolist()` / `.cpu()` pattern (a device-to-host read).
_SCALAR_READ_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::to", "aten::_to_copy",
                    "aten::copy_", "aten::nonzero", "aten::is_nonzero", "aten::tolist")
LAUNCH_DELAY_PERCENTILES = (50, 90, 99)


@dataclass
class RuntimeCall:
    """One runtime/driver API, aggregated."""

    name: str
    calls: int
    total_us: float
    mean_us: float
    max_us: float
    gpu_idle_us: float  # host time in these calls while the GPU was idle


@dataclass
class SyncSite:
    """Blocking synchronisations grouped by call and the code that made them."""

    call: str
    op: str  # innermost enclosing torch op ("" when none)
    site: str  # nearest user Python frame ("" when the trace has no Python stacks)
    stack: list[str]  # Python frames of the largest occurrence, outermost first
    calls: int
    host_wait_us: float  # time the host spent blocked in these calls
    gpu_idle_after_us: float  # GPU idle from the call's return to the next GPU activity
    stall_us: float  # sum over calls of min(host wait, GPU idle after): what removing it can save
    steps: list[int]  # step numbers where it occurred


@dataclass
class RuntimeAnalysis:
    calls: list[RuntimeCall]
    syncs: list[SyncSite]
    launch_delay_us: dict  # {"count", "mean", "p50", "p90", "p99", "max"}


def launch_delay(rt: RankTrace) -> dict:
    """Distribution of kernel start minus launch-call start (µs)."""
    k = rt.kernels
    out = {"count": 0, "mean": None, "max": None, **{f"p{p}": None for p in LAUNCH_DELAY_PERCENTILES}}
    if not len(k) or not len(rt.runtime):
        return out
    lr = launch_rows(rt.runtime, k)
    ok = lr >= 0
    if not ok.any():
        return out
    d = (k["ts"][ok] - rt.runtime["ts"][lr[ok]]) / NS_PER_US
    out.update(count=int(len(d)), mean=float(d.mean()), max=float(d.max()),
               **{f"p{p}": float(np.percentile(d, p)) for p in LAUNCH_DELAY_PERCENTILES})
    return out


def runtime_analysis(rt: RankTrace, steps: Steps | None = None, top: int = 15) -> RuntimeAnalysis:
    """Per-call statistics, blocking syncs by site (with the steps they occur in), launch delay."""
    steps = steps if steps is not None else find_steps(rt)

    def step_of(ts: np.ndarray) -> np.ndarray:
        i = steps.index_of(ts)
        return npx.take(steps.number, i, -1)

    r = rt.runtime
    if not len(r):
        return RuntimeAnalysis([], [], launch_delay(rt))
    gpu = has_gpu(rt)
    busy = gpu_busy(rt)
    names = r.strings("name")
    ts, dur = r["ts"], r["dur"]
    idle = idle_ns(busy, ts, ts + dur) if gpu else np.zeros(len(r), dtype=np.int64)
    n = len(names.labels)
    cnt = np.bincount(names.codes, minlength=n)
    tot = np.bincount(names.codes, weights=dur, minlength=n)
    idl = np.bincount(names.codes, weights=idle, minlength=n)
    mx = np.zeros(n)
    np.maximum.at(mx, names.codes, dur)
    calls = [RuntimeCall(names.labels[c], int(cnt[c]), tot[c] / NS_PER_US, tot[c] / cnt[c] / NS_PER_US,
                         mx[c] / NS_PER_US, idl[c] / NS_PER_US)
             for c in np.argsort(-tot)[:top] if cnt[c]]
    return RuntimeAnalysis(calls, sync_sites(rt, step_of), launch_delay(rt))


def sync_sites(rt: RankTrace, step_of=None) -> list[SyncSite]:
    """Blocking sync calls grouped by (call, enclosing op, user frame), largest cost first."""
    r = rt.runtime
    if not len(r):
        return []
    m = r.strings("name").isin_labels(classify.is_sync_call)
    rows = np.nonzero(m)[0]
    if not len(rows):
        return []
    tree = host_tree(rt)
    ends = r["ts"][rows] + r["dur"][rows]
    # GPU idle after the sync returns: until the next GPU activity starts
    starts = np.sort(np.concatenate([rt.kernels["ts"] if len(rt.kernels) else np.zeros(0, np.int64),
                                     rt.memops["ts"] if len(rt.memops) else np.zeros(0, np.int64)]))
    after = np.zeros(len(rows), dtype=np.int64)
    if len(starts):
        busy = gpu_busy(rt)
        nxt_i = np.searchsorted(starts, ends, side="left")
        has_next = nxt_i < len(starts)
        nxt = np.where(has_next, starts[np.minimum(nxt_i, len(starts) - 1)], ends)
        # only a GPU that is idle when the call returns waits for the host to refill it
        after = np.where(idle_ns(busy, ends, ends + 1) > 0, nxt - ends, 0)
    nodes = tree.runtime_node[rows]
    ops = tree.nearest(nodes, OP)
    groups: dict[tuple[str, str, str], list[int]] = {}
    op_names = [tree.name(o) if o >= 0 else "" for o in ops]
    # per distinct (op, python parent) pair; the number of syncs is small compared to events
    py = tree.nearest(npx.take(tree.parent, nodes, -1), PYTHON)
    site_cache: dict[int, str] = {}
    for i, row in enumerate(rows):
        p = int(py[i])
        if p not in site_cache:
            site_cache[p] = tree.user_site(p) if p >= 0 else ""
        key = (r.strings("name").labels[r.strings("name").codes[row]], op_names[i], site_cache[p])
        groups.setdefault(key, []).append(i)
    out = []
    dur = r["dur"][rows]
    for (call, op, site), idx in groups.items():
        idx_a = np.array(idx)
        big = idx_a[np.argmax(dur[idx_a])]
        stack = tree.stack(int(py[big])) if py[big] >= 0 else []
        steps = sorted({int(s) for s in step_of(r["ts"][rows[idx_a]])} - {-1}) if step_of else []
        out.append(SyncSite(call=call, op=op, site=site, stack=stack, calls=len(idx),
                            host_wait_us=float(dur[idx_a].sum()) / NS_PER_US,
                            gpu_idle_after_us=float(after[idx_a].sum()) / NS_PER_US,
                            stall_us=float(np.minimum(dur[idx_a], after[idx_a]).sum()) / NS_PER_US, steps=steps))
    out.sort(key=lambda s: (-s.stall_us, -s.host_wait_us))
    return out


def is_scalar_read(op: str) -> bool:
    """True for ops that read a GPU value on the host (`.item()`, `.cpu()`, `.tolist()`...)."""
    return op.startswith(_SCALAR_READ_OPS)
