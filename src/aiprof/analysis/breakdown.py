"""Per-step GPU time breakdown. Every term is defined in docs/metrics.md ("Breakdown").

Each instant of a step's window is given to exactly one class, by priority
compute > communication > memory > idle, so the four parts add up to the step's duration.
Overlapped communication and memory time are reported beside the partition.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof.analysis.intervals import Union, union, union_of
from aiprof.analysis.launch import launch_ts
from aiprof.analysis.loading import loading_union
from aiprof.analysis.memo import analysis_cache
from aiprof.analysis.steps import Steps
from aiprof.trace import classify
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0


@dataclass
class StepBreakdown:
    """One step of one rank (all times in µs)."""

    step: int
    start_ns: int
    duration_us: float
    compute_us: float
    communication_us: float  # communication not overlapped by compute (exposed)
    memory_us: float  # memcpy/memset overlapped by neither compute nor communication
    idle_us: float
    communication_total_us: float  # union of communication kernels, overlapped or not
    communication_overlapped_us: float
    memory_total_us: float
    memory_exposed_us: float  # memcpy/memset not overlapped by compute
    gpu_busy_pct: float
    kernels_launched: int
    gpu_time_launched_us: float  # summed durations of GPU work launched in this step
    runtime_us: float  # host time inside CUDA runtime/driver calls
    sync_us: float  # host time inside synchronising calls
    dataloader_us: float  # the training thread's time in data loading (analysis.loading, docs)


@dataclass
class GpuUnions:
    compute: Union
    comm: Union
    memory: Union
    compute_comm: Union
    all: Union


def gpu_unions(rt: RankTrace) -> GpuUnions:
    """Unions of the rank's compute, communication and memory activity on the GPU (cached on
    the rank object: a rank's analyses ask for them a dozen times)."""
    cache = analysis_cache(rt)
    if "gpu_unions" not in cache:
        cache["gpu_unions"] = _gpu_unions(rt)
    return cache["gpu_unions"]


def _gpu_unions(rt: RankTrace) -> GpuUnions:
    k = rt.kernels
    m = rt.memops
    if len(k):
        is_comm = k.strings("cls").isin_labels(lambda s: s == classify.COMMUNICATION)
        ks, ke = k["ts"], k["ts"] + k["dur"]
        compute = union(ks[~is_comm], ke[~is_comm])
        comm = union(ks[is_comm], ke[is_comm])
    else:
        compute = comm = union(np.zeros(0), np.zeros(0))
    memory = union(m["ts"], m["ts"] + m["dur"]) if len(m) else union(np.zeros(0), np.zeros(0))
    cc = union_of(compute, comm)
    return GpuUnions(compute, comm, memory, cc, union_of(cc, memory))


def _host_sums(rt: RankTrace, steps: Steps) -> tuple[np.ndarray, np.ndarray]:
    """Per-step host time in all runtime/driver calls, and in synchronising ones (ns)."""
    n = len(steps)
    rt_all = np.zeros(n, dtype=np.int64)
    rt_sync = np.zeros(n, dtype=np.int64)
    r = rt.runtime
    if len(r):
        idx = steps.index_of(r["ts"])
        ok = idx >= 0
        np.add.at(rt_all, idx[ok], r["dur"][ok])
        sync = r.strings("name").isin_labels(classify.is_sync_call) & ok
        np.add.at(rt_sync, idx[sync], r["dur"][sync])
    return rt_all, rt_sync


def step_breakdown(rt: RankTrace, steps: Steps) -> list[StepBreakdown]:
    """The breakdown of every step of ``rt``."""
    u = gpu_unions(rt)
    a, b = steps.start, steps.end
    dur = b - a
    comp = u.compute.covered(a, b)
    cc = u.compute_comm.covered(a, b)
    busy = u.all.covered(a, b)
    comm_tot = u.comm.covered(a, b)
    mem_tot = u.memory.covered(a, b)
    mem_or_comp = union_of(u.compute, u.memory).covered(a, b)
    dl = loading_union(rt).covered(a, b)
    rt_all, rt_sync = _host_sums(rt, steps)

    launched = np.zeros(len(steps), dtype=np.int64)
    launched_ns = np.zeros(len(steps), dtype=np.int64)
    for name in ("kernels", "memops"):
        g = rt.table(name)
        if len(g):
            idx = steps.index_of(launch_ts(rt.runtime, g))
            ok = idx >= 0
            np.add.at(launched, idx[ok], 1 if name == "kernels" else 0)
            np.add.at(launched_ns, idx[ok], g["dur"][ok])

    out = []
    for i in range(len(steps)):
        d = float(dur[i])
        exposed_comm = float(cc[i] - comp[i])
        out.append(StepBreakdown(
            step=int(steps.number[i]),
            start_ns=int(a[i]),
            duration_us=d / NS_PER_US,
            compute_us=float(comp[i]) / NS_PER_US,
            communication_us=exposed_comm / NS_PER_US,
            memory_us=float(busy[i] - cc[i]) / NS_PER_US,
            idle_us=float(d - busy[i]) / NS_PER_US,
            communication_total_us=float(comm_tot[i]) / NS_PER_US,
            communication_overlapped_us=float(comm_tot[i] - exposed_comm) / NS_PER_US,
            memory_total_us=float(mem_tot[i]) / NS_PER_US,
            memory_exposed_us=float(mem_or_comp[i] - comp[i]) / NS_PER_US,
            gpu_busy_pct=100.0 * float(busy[i]) / d if d > 0 else 0.0,
            kernels_launched=int(launched[i]),
            gpu_time_launched_us=float(launched_ns[i]) / NS_PER_US,
            runtime_us=float(rt_all[i]) / NS_PER_US,
            sync_us=float(rt_sync[i]) / NS_PER_US,
            dataloader_us=float(dl[i]) / NS_PER_US,
        ))
    return out
