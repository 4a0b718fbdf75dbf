"""aiprof's unique helpers give exactly numpy's answers."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof import npx


@pytest.mark.parametrize("n,hi", [(0, 5), (1, 5), (1000, 7), (5000, 10**15)])
def test_unique_matches_numpy(n, hi):
    a = np.random.default_rng(n).integers(0, hi, n)
    for kw in (dict(), dict(return_inverse=True), dict(return_counts=True),
               dict(return_inverse=True, return_counts=True)):
        ours, theirs = npx.unique(a, **kw), np.unique(a, **kw)
        ours = ours if isinstance(ours, tuple) else (ours,)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        for o, t in zip(ours, theirs):
            assert np.array_equal(o, np.asarray(t).ravel())


def test_unique_pairs_matches_numpy_axis():
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 4, 3000), rng.integers(0, 50, 3000)
    ux, uy, inv = npx.unique_pairs(x, y)
    want, winv = np.unique(np.stack([x, y]), axis=1, return_inverse=True)
    assert np.array_equal(ux, want[0]) and np.array_equal(uy, want[1]) and np.array_equal(inv, winv.ravel())


@pytest.mark.parametrize("n,lo,hi", [(1, -1, 3), (2000, -1, 4), (2000, -(1 << 40), 1 << 40)])
def test_unique_rows_matches_numpy_axis(n, lo, hi):
    a = np.random.default_rng(n).integers(lo, hi, (n, 4))
    keys, first, inv = npx.unique_rows(a)
    want, wfirst, winv = np.unique(a, axis=0, return_index=True, return_inverse=True)
    assert np.array_equal(keys, want) and np.array_equal(first, wfirst) and np.array_equal(inv, winv.ravel())
    empty = npx.unique_rows(np.zeros((0, 4), np.int64))
    assert [len(x) for x in empty] == [0, 0, 0]


@pytest.mark.parametrize("n", [0, 1, 3000])
def test_unique_runs_matches_numpy(n):
    rng = np.random.default_rng(n)
    a = np.concatenate([np.sort(rng.integers(0, 500, n)), np.sort(rng.integers(-5, 50, n)), rng.integers(0, 9, n)])
    assert np.array_equal(npx.unique_runs(a), np.unique(a))
