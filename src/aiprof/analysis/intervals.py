"""Interval unions over nanosecond timestamps, vectorised with numpy.

The breakdown asks "how much of window [a, b) is covered by these intervals" for every step;
building the union once and answering each window with two binary searches keeps that
O((n + steps) log n).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Union:
    """Disjoint, sorted segments [start[i], end[i]) with a prefix sum of their lengths."""

    start: np.ndarray
    end: np.ndarray
    cum: np.ndarray  # cum[i] = total length of segments [0, i)

    @property
    def total(self) -> int:
        return int(self.cum[-1])

    def covered(self, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
        """Length of [a, b) covered by the union, for scalars or arrays of windows."""
        a = np.atleast_1d(np.asarray(a, dtype=np.int64))
        b = np.atleast_1d(np.asarray(b, dtype=np.int64))
        if len(self.start) == 0:
            return np.zeros(len(a), dtype=np.int64)
        i = np.searchsorted(self.end, a, side="right")  # first segment ending after a
        j = np.searchsorted(self.start, b, side="left")  # segments [0, j) start before b
        out = self.cum[np.maximum(j, i)] - self.cum[i]
        has = j > i
        ii = np.minimum(i, len(self.start) - 1)
        jj = np.maximum(j - 1, 0)
        head = np.where(has, np.maximum(0, a - self.start[ii]), 0)
        tail = np.where(has, np.maximum(0, self.end[jj] - b), 0)
        return np.maximum(out - head - tail, 0)


def union(start: np.ndarray, end: np.ndarray) -> Union:
    """Merge possibly overlapping intervals into a :class:`Union`."""
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    keep = end > start
    start, end = start[keep], end[keep]
    if len(start) == 0:
        z = np.zeros(0, dtype=np.int64)
        return Union(z, z, np.zeros(1, dtype=np.int64))
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    # a new segment begins where an interval starts after everything before it has ended
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    seg_start = s[new]
    last = np.append(np.nonzero(new)[0][1:] - 1, len(s) - 1)
    seg_end = reach[last]
    cum = np.concatenate([[0], np.cumsum(seg_end - seg_start)]).astype(np.int64)
    return Union(seg_start, seg_end, cum)


def union_of(*unions: Union) -> Union:
    """Union of several unions."""
    return union(np.concatenate([u.start for u in unions]), np.concatenate([u.end for u in unions]))
