"""Collective communication: by type, process group and message size; bandwidths; exposed time;
link class. Definitions in docs/metrics.md ("Communication"); who waits for whom across ranks
is analysis/ranks.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.breakdown import GpuUnions, gpu_unions
from aiprof.analysis.intervals import union, union_of
from aiprof.trace import classify
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
# bytes per element of the dtype names found in record_param_comms args
DTYPE_BYTES = {"Float": 4, "float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4,
               "Byte": 1, "Char": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Short": 2}
# NCCL's bus-bandwidth factors (nccl-tests PERFORMANCE.md): busbw = algbw * factor(n)
BUSBW_FACTOR = {
    "AllReduce": lambda n: 2.0 * (n - 1) / n,
    "AllGather": lambda n: (n - 1) / n,
    "ReduceScatter": lambda n: (n - 1) / n,
    "AllToAll": lambda n: (n - 1) / n,
    "Broadcast": lambda n: 1.0,
    "Reduce": lambda n: 1.0,
    "SendRecv": lambda n: 1.0,
}
# Highest unidirectional bandwidth a PCIe Gen5 x16 link can carry (GB/s): a bus bandwidth
# above it can only have gone over NVLink (or NVSwitch).
PCIE_GEN5_X16_GBPS = 64.0
_SIZE_BUCKETS = (1 << 10, 1 << 16, 1 << 20, 16 << 20, 256 << 20)
_SIZE_NAMES = ("<1 KiB", "1–64 KiB", "64 KiB–1 MiB", "1–16 MiB", "16–256 MiB", "≥256 MiB")


@dataclass
class CollectiveGroup:
    """Collectives of one type, process group and message-size bucket (GPU side)."""

    coll: str
    pg: str
    size_bucket: str
    calls: int
    bytes_per_call: float  # mean message size (input)
    total_us: float
    mean_us: float
    algbw_gbps: float  # bytes / duration, over the summed duration of the group
    busbw_gbps: float
    group_size: int


@dataclass
class CommAnalysis:
    groups: list[CollectiveGroup]
    by_type: dict  # {coll: {"calls", "total_us", "exposed_us"}}
    total_us: float  # union of communication kernels
    exposed_us: float  # communication not overlapped by compute
    link: str  # "NVLink", "intra-node (NVLink or PCIe)", "inter-node", "unknown"
    link_reason: str


def _bucket(nbytes: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array(_SIZE_BUCKETS), nbytes, side="right")


def exposed_by_type(rt: RankTrace, u: GpuUnions, lo, hi) -> dict[str, tuple[int, int, int]]:
    """Per collective type (from kernel names): calls and summed kernel ns over the whole trace,
    and ns not overlapped by compute inside the window(s) ``[lo, hi)`` (scalars or arrays)."""
    k = rt.kernels
    out: dict[str, tuple[int, int, int]] = {}
    if not len(k):
        return out
    names = k.strings("name")
    is_comm = k.strings("cls").isin_labels(lambda s: s == classify.COMMUNICATION)
    ctype = np.array([classify.collective_type(s) or "other" for s in names.labels] + [""], dtype=object)
    types = ctype[names.codes]
    comp = int(u.compute.covered(lo, hi).sum())
    for t in sorted(set(types[is_comm])):
        m = is_comm & (types == t)
        cu = union(k["ts"][m], (k["ts"] + k["dur"])[m])
        out[t] = (int(m.sum()), int(k["dur"][m].sum()), int(union_of(u.compute, cu).covered(lo, hi).sum()) - comp)
    return out


def comm_analysis(rt: RankTrace, lo: int | None = None, hi: int | None = None) -> CommAnalysis:
    """Communication of one rank over [lo, hi) (defaults to all of it)."""
    u = gpu_unions(rt)
    if lo is None or hi is None:
        lo, hi = (int(u.all.start[0]), int(u.all.end[-1])) if len(u.all.start) else (0, 0)
    comp = int(u.compute.covered(lo, hi)[0])
    total = int(u.comm.covered(lo, hi)[0])
    exposed = int(u.compute_comm.covered(lo, hi)[0]) - comp
    by_type = {t: {"calls": calls, "total_us": kern_ns / NS_PER_US, "exposed_us": exp_ns / NS_PER_US}
               for t, (calls, kern_ns, exp_ns) in exposed_by_type(rt, u, lo, hi).items()}
    groups = _groups(rt)
    link, why = link_class(rt, groups)
    return CommAnalysis(groups, by_type, total / NS_PER_US, exposed / NS_PER_US, link, why)


def _groups(rt: RankTrace) -> list[CollectiveGroup]:
    c = rt.collectives
    if not len(c):
        return []
    gpu = c.strings("side").isin_labels(lambda s: s == "gpu")
    if not gpu.any():
        return []
    c = c.take(gpu)
    coll, pg, dtype = c.strings("coll"), c.strings("pg_name"), c.strings("dtype")
    esize = np.array([DTYPE_BYTES.get(s, 0) for s in dtype.labels] + [0], dtype=np.float64)[dtype.codes]
    nbytes = np.maximum(c["in_nelems"], 0) * esize
    bucket = _bucket(nbytes)
    key = (coll.codes.astype(np.int64) * (len(pg.labels) + 1) + pg.codes) * (len(_SIZE_NAMES) + 1) + bucket
    keys, inv = npx.unique(key, return_inverse=True)
    dur = c["dur"].astype(np.float64)
    tot = np.bincount(inv, weights=dur)
    cnt = np.bincount(inv)
    byt = np.bincount(inv, weights=nbytes)
    gsz = np.zeros(len(keys), dtype=np.int64)
    np.maximum.at(gsz, inv, c["group_size"])
    first = np.zeros(len(keys), dtype=np.int64)
    first[inv[::-1]] = np.arange(len(inv))[::-1]
    out = []
    for g in np.argsort(-tot):
        i = first[g]
        t = coll.labels[coll.codes[i]]
        n = max(int(gsz[g]), 1)
        alg = byt[g] / tot[g] if tot[g] > 0 else 0.0  # bytes/ns == GB/s
        fac = BUSBW_FACTOR.get(t, lambda n: 1.0)(n) if n > 1 else 1.0
        out.append(CollectiveGroup(coll=t, pg=pg.labels[pg.codes[i]], size_bucket=_SIZE_NAMES[bucket[i]],
                                   calls=int(cnt[g]), bytes_per_call=float(byt[g] / cnt[g]),
                                   total_us=float(tot[g]) / NS_PER_US, mean_us=float(tot[g] / cnt[g]) / NS_PER_US,
                                   algbw_gbps=float(alg), busbw_gbps=float(alg * fac), group_size=n))
    return out


def link_class(rt: RankTrace, groups: list[CollectiveGroup]) -> tuple[str, str]:
    """Best guess of the link the collectives used, with the reason (Kineto does not record it)."""
    if not groups:
        return "unknown", "no collectives with sizes in the trace"
    best = max(g.busbw_gbps for g in groups)
    if best > PCIE_GEN5_X16_GBPS:
        return "NVLink", f"bus bandwidth {best:.0f} GB/s exceeds PCIe Gen5 x16 ({PCIE_GEN5_X16_GBPS:.0f} GB/s)"
    world = rt.world_size
    ndev = len(rt.meta.get("device_properties") or [])
    if world > 1 and ndev >= world:
        return "intra-node (NVLink or PCIe)", (f"all {world} ranks fit on the {ndev} GPUs this host shows; "
                                               f"peak bus bandwidth {best:.1f} GB/s")
    return "unknown", f"peak bus bandwidth {best:.1f} GB/s"

