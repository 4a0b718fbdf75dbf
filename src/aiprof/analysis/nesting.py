"""Interval nesting on one thread, vectorised: depth, parent and "innermost interval at t".

Host events of one thread (Python frames, torch ops, annotations, runtime calls) form a
forest: each interval lies inside its caller's. Walking that forest with a Python stack is
O(n) interpreted steps; here everything is a sort plus binary searches, O(n log n) in numpy.

The trick: with intervals sorted by (start asc, end desc), interval i's depth is the number of
earlier intervals still open at its start, ``i - #{ends <= start_i}``; its parent is the last
earlier interval one level up. Both are searches over sorted arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Nesting:
    """The forest of one thread's intervals, in sorted order (see :func:`nest`).

    ``start``/``end`` are the (repaired) bounds in sorted order, ``order`` maps sorted position
    to the caller's row, ``depth`` and ``parent`` (sorted position, -1 for roots) describe the
    forest, and ``_keys`` (depth * n + position, sorted) answers "last interval at depth d
    before position p".
    """

    start: np.ndarray
    end: np.ndarray
    order: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    sorted_ends: np.ndarray
    _keys: np.ndarray
    repaired: int  # intervals whose end was clipped to their parent's (partial overlaps)

    def __len__(self) -> int:
        return len(self.start)

    def _last_at_depth(self, depth: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Sorted position of the last interval at ``depth`` whose position is <= ``pos``."""
        n = len(self.start)
        k = np.searchsorted(self._keys, depth * n + pos, side="right") - 1
        kk = np.maximum(k, 0)
        hit = (k >= 0) & (self._keys[kk] // max(n, 1) == depth) & (depth >= 0)
        return np.where(hit, self._keys[kk] % max(n, 1), -1)

    def innermost_at(self, t: np.ndarray) -> np.ndarray:
        """Sorted position of the innermost interval containing each instant ``t``, or -1."""
        t = np.asarray(t, dtype=np.int64)
        if not len(self.start):
            return np.full(len(t), -1, dtype=np.int64)
        last = np.searchsorted(self.start, t, side="right") - 1  # last interval starting <= t
        open_ = (last + 1) - np.searchsorted(self.sorted_ends, t, side="right")
        return self._last_at_depth(open_ - 1, last)


def _depth_parent(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = len(start)
    sorted_ends = np.sort(end)
    pos = np.arange(n, dtype=np.int64)
    # every interval ending at or before start_i sorts before i (ends exceed starts), so this
    # global count is the count among earlier intervals
    depth = pos - np.searchsorted(sorted_ends, start, side="right")
    keys = np.sort(depth * n + pos)
    k = np.searchsorted(keys, (depth - 1) * n + pos, side="left") - 1
    kk = np.maximum(k, 0)
    parent = np.where((depth > 0) & (k >= 0) & (keys[kk] // max(n, 1) == depth - 1), keys[kk] % max(n, 1), -1)
    return depth, parent, sorted_ends, keys


def nest(start: np.ndarray, end: np.ndarray, tiebreak: np.ndarray | None = None, max_repairs: int = 8) -> Nesting:
    """Build the forest of one thread's intervals ``[start, end)`` (ns).

    ``tiebreak`` orders intervals with equal bounds (lower = outer), e.g. a Python frame
    before the op it calls. Zero-length intervals are widened to 1 ns so that they nest.
    A child that ends after its parent (clock rounding between event sources) is clipped to
    the parent's end, so that the forest is a true nesting; ``repaired`` counts those.
    """
    start = np.asarray(start, dtype=np.int64)
    end = np.maximum(np.asarray(end, dtype=np.int64), start + 1)
    tb = np.zeros(len(start), dtype=np.int64) if tiebreak is None else np.asarray(tiebreak, dtype=np.int64)
    order = np.lexsort((tb, -end, start))
    s, e = start[order], end[order]
    repaired = 0
    for _ in range(max_repairs):
        depth, parent, sorted_ends, keys = _depth_parent(s, e)
        has = parent >= 0
        over = np.zeros(len(s), dtype=bool)
        over[has] = e[has] > e[parent[has]]
        if not over.any():
            break
        repaired += int(over.sum())
        e = e.copy()
        e[over] = np.maximum(e[parent[over]], s[over] + 1)
    return Nesting(s, e, order, depth, parent, sorted_ends, keys, repaired)
