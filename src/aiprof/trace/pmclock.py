"""PM samples onto the trace clock, and a check of that alignment against the kernels.

PM sampling stamps each sample with CUPTI's GPU timestamps (ns). The agent reads pairs of
(``cuptiGetTimestamp``, host ``CLOCK_REALTIME``) when sampling starts and stops; a line through
them maps CUPTI time to unix time (it absorbs drift between the two clocks over the capture),
and the capture's existing marker offset (``trace_minus_unix_us``, agent/capture.py) maps unix
time to the trace clock. :func:`cupti_to_trace_us` does both.

:func:`alignment_check` verifies the result on the data itself: it cross-correlates the SM-active
counter with the share of each instant in which the trace shows a kernel running, over lags of
up to ``MAX_LAG_US``; the best lag is the residual misalignment. docs/capture.md ("PM samples on
the trace clock") describes both.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Largest residual the check searches for: 5 ms covers a wrong host clock pair by far, while
#: staying under a GPT-2 step so the step pattern cannot alias to a neighbour step.
MAX_LAG_US = 5000.0
#: Below this correlation the check says nothing: an idle GPU or constant load has no edges.
MIN_CORRELATION = 0.3
#: Fewer samples than this cannot carry a correlation.
MIN_SAMPLES = 50


def cupti_to_unix_ns(t: np.ndarray, pairs: list[dict]) -> np.ndarray:
    """CUPTI ns -> unix ns through the clock pairs (line through the first and last, else one offset)."""
    t = np.asarray(t, dtype=np.float64)
    if not pairs:
        raise ValueError("no clock pairs")
    c0, u0 = float(pairs[0]["cupti_ns"]), float(pairs[0]["unix_ns"])
    if len(pairs) >= 2 and float(pairs[-1]["cupti_ns"]) > c0:
        c1, u1 = float(pairs[-1]["cupti_ns"]), float(pairs[-1]["unix_ns"])
        slope = (u1 - u0) / (c1 - c0)
        return u0 + (t - c0) * slope
    return u0 + (t - c0)


def drift_ppm(pairs: list[dict]) -> float | None:
    """How fast the CUPTI clock runs against the host's, in parts per million (None: one pair)."""
    if len(pairs) < 2:
        return None
    dc = float(pairs[-1]["cupti_ns"]) - float(pairs[0]["cupti_ns"])
    du = float(pairs[-1]["unix_ns"]) - float(pairs[0]["unix_ns"])
    return (dc - du) / du * 1e6 if du > 0 else None


def cupti_to_trace_us(t: np.ndarray, pairs: list[dict], trace_minus_unix_us: float) -> np.ndarray:
    """CUPTI ns -> trace µs."""
    return cupti_to_unix_ns(t, pairs) / 1000.0 + float(trace_minus_unix_us)


@dataclass
class AlignmentCheck:
    """Residual lag (µs; positive = counters late against the kernels) and its correlation."""

    lag_us: float | None
    correlation: float | None
    samples: int
    why: str = ""  # when lag_us is None: why the check could not tell


def alignment_check(t0_us: np.ndarray, t1_us: np.ndarray, activity: np.ndarray,
                    k_start_us: np.ndarray, k_end_us: np.ndarray, max_lag_us: float = MAX_LAG_US) -> AlignmentCheck:
    """Best lag between a counter of SM activity and the trace's kernel-busy signal.

    Both are put on a grid of a quarter sample period over the samples' span; the kernel signal
    is 1 where any kernel runs. The lag maximising the Pearson correlation is returned.
    """
    t0 = np.asarray(t0_us, dtype=np.float64)
    t1 = np.asarray(t1_us, dtype=np.float64)
    v = np.asarray(activity, dtype=np.float64)
    n = len(t0)
    if n < MIN_SAMPLES:
        return AlignmentCheck(None, None, n, f"{n} samples (< {MIN_SAMPLES})")
    period = float(np.median(np.diff(t0)))
    if not period > 0:
        return AlignmentCheck(None, None, n, "sample times do not increase")
    step = period / 4.0
    grid = np.arange(t0[0], t1[-1], step)
    busy = np.zeros(len(grid) + 1)
    ks, ke = np.asarray(k_start_us, dtype=np.float64), np.asarray(k_end_us, dtype=np.float64)
    i0 = np.searchsorted(grid, ks)
    i1 = np.searchsorted(grid, ke)
    np.add.at(busy, i0, 1.0)
    np.add.at(busy, i1, -1.0)
    busy = (np.cumsum(busy)[:-1] > 0).astype(np.float64)
    val = np.interp(grid, (t0 + t1) / 2.0, v)
    lags = int(max_lag_us / step)
    if len(grid) <= 2 * lags + 10:
        return AlignmentCheck(None, None, n, "samples span too short for the lag search")
    core = slice(lags, len(grid) - lags)
    b = busy[core]
    if b.std() == 0:
        return AlignmentCheck(None, None, n, "kernels cover all or none of the span: no edges to align")
    best_i, best_c = 0, -2.0
    for li in range(-lags, lags + 1):
        s = val[lags + li: len(grid) - lags + li]
        if s.std() == 0:
            continue
        c = float(np.corrcoef(s, b)[0, 1])
        if c > best_c:
            best_i, best_c = li, c
    if best_c < MIN_CORRELATION:
        return AlignmentCheck(None, best_c if best_c > -2 else None, n, f"correlation {best_c:.2f} < {MIN_CORRELATION}")
    return AlignmentCheck(best_i * step, best_c, n)
