"""Launch links: each GPU event to the CUDA runtime/driver call that launched it (by correlation)."""
from __future__ import annotations

import numpy as np

from aiprof.trace.table import Table


def launch_rows(runtime: Table, gpu: Table) -> np.ndarray:
    """Row index in ``runtime`` of the launch of each ``gpu`` row, or -1 when not in the trace."""
    if not len(gpu):
        return np.zeros(0, dtype=np.int64)
    if not len(runtime):
        return np.full(len(gpu), -1, dtype=np.int64)
    rc = runtime["corr"]
    order = np.argsort(rc, kind="stable")
    sorted_corr = rc[order]
    gc = gpu["corr"]
    pos = np.searchsorted(sorted_corr, gc)
    pos_c = np.minimum(pos, len(sorted_corr) - 1)
    hit = (pos < len(sorted_corr)) & (sorted_corr[pos_c] == gc) & (gc >= 0)
    return np.where(hit, order[pos_c], -1)


def launch_ts(runtime: Table, gpu: Table) -> np.ndarray:
    """Host timestamp of each GPU row's launch; the GPU start where the launch is unknown."""
    rows = launch_rows(runtime, gpu)
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    ts = gpu["ts"].copy()
    have = rows >= 0
    if have.any():  # a GPU-only export has no runtime table at all
        ts[have] = runtime["ts"][rows[have]]
    return ts
