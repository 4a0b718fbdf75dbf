"""GPU kernel statistics per kernel name. Definitions in docs/metrics.md ("Kernels")."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0


@dataclass
class KernelStat:
    name: str
    cls: str  # compute | communication
    calls: int
    total_us: float
    mean_us: float
    median_us: float
    p95_us: float
    share_pct: float  # of the summed duration of all kernels of the rank


def kernel_stats(rt: RankTrace, top: int | None = None) -> list[KernelStat]:
    """Per kernel name: calls and time statistics, sorted by total time (descending)."""
    k = rt.kernels
    if not len(k):
        return []
    names = k.strings("name")
    cls = k.strings("cls")
    codes, dur = names.codes, k["dur"]
    total_all = float(dur.sum()) or 1.0
    totals = np.bincount(codes, weights=dur, minlength=len(names.labels))
    counts = np.bincount(codes, minlength=len(names.labels))
    order = np.argsort(-totals, kind="stable")
    if top is not None:
        order = order[:top]
    by_code = np.argsort(codes, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    cls_of = np.zeros(len(names.labels), dtype=np.int32)
    cls_of[codes] = cls.codes
    out = []
    for c in order:
        if counts[c] == 0:
            continue
        d = dur[by_code[bounds[c]:bounds[c + 1]]]
        out.append(KernelStat(
            name=names.labels[c], cls=cls.labels[cls_of[c]], calls=int(counts[c]),
            total_us=float(totals[c]) / NS_PER_US, mean_us=float(d.mean()) / NS_PER_US,
            median_us=float(np.median(d)) / NS_PER_US, p95_us=float(np.percentile(d, 95)) / NS_PER_US,
            share_pct=100.0 * float(totals[c]) / total_all,
        ))
    return out
