"""The vectorised nesting against a plain stack walk, on random forests."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.analysis.nesting import nest


def _random_forest(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Properly nested intervals: recursive splits of [0, 10^6) with gaps and ties."""
    starts, ends = [], []

    def split(a: int, b: int, budget: int) -> None:
        while budget > 0 and b - a > 4:
            s = int(rng.integers(a, b - 2))
            e = int(rng.integers(s + 1, min(b, s + max(2, (b - a) // 2)) + 1))
            starts.append(s)
            ends.append(e)
            budget -= 1
            k = int(rng.integers(0, budget + 1)) // 2
            split(s, e, k)
            budget -= k
            a = e

    split(0, 10**6, n)
    return np.array(starts, np.int64), np.array(ends, np.int64)


def _brute(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Parent (in sorted order) by a stack walk, and the sort order used."""
    order = np.lexsort((-end, start))
    s, e = start[order], end[order]
    parent = np.full(len(s), -1)
    stack: list[int] = []
    for i in range(len(s)):
        while stack and e[stack[-1]] <= s[i]:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    return parent, order


@pytest.mark.parametrize("seed", range(5))
def test_parent_and_innermost_match_a_stack_walk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    start, end = _random_forest(rng, 400)
    ns = nest(start, end)
    parent, order = _brute(start, end)
    assert ns.repaired == 0
    assert np.array_equal(ns.order, order)
    assert np.array_equal(ns.parent, parent)
    # innermost interval at random instants: the deepest one containing t
    t = rng.integers(0, 10**6, 500)
    got = ns.innermost_at(t)
    s, e = start[order], end[order]
    for ti, gi in zip(t.tolist(), got.tolist()):
        inside = np.nonzero((s <= ti) & (ti < e))[0]
        want = inside[-1] if len(inside) else -1  # latest start among containing = innermost
        assert gi == want


def test_partial_overlap_is_clipped_to_the_parent() -> None:
    # [0,10) holds [2,11): one ns past its parent's end (clock rounding between sources)
    ns = nest(np.array([0, 2, 4]), np.array([10, 11, 5]))
    assert ns.repaired == 1
    assert ns.parent.tolist() == [-1, 0, 1]
    assert ns.end.tolist() == [10, 10, 5]


def test_zero_length_and_tie_break() -> None:
    # a Python frame and the op it calls share bounds: the tie-break puts the frame outside
    ns = nest(np.array([5, 5, 5]), np.array([9, 9, 5]), tiebreak=np.array([2, 0, 1]))
    assert ns.order.tolist() == [1, 0, 2]
    assert ns.parent.tolist() == [-1, 0, 1]
