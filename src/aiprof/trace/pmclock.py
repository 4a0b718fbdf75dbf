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
#: The check reads at most this many grid points (a quarter period each: ~1 s at 100 µs), so a
#: 60 s capture costs what a short one does.
MAX_GRID = 40_000


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
    grid = np.arange(t0[0], min(t1[-1], t0[0] + MAX_GRID * step), step)
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


#: A decoded sample ends at most this long before the decode that read it (the decode thread
#: runs every 10 ms; a full second allows for a descheduled thread). Longer: another domain.
MAX_DECODE_LAG_NS = 1e9
#: A kept sample's window is at most this many times the median window: CUPTI hands some
#: samples around a domain switch a zero start time (seen on H100), which would span seconds.
MAX_WINDOW_RATIO = 10.0
#: Two clock pairs belong to one timestamp domain when the slope between them matches the
#: domain's within this (the CUPTI clock is the host's, or a TSC, or the GPU timer: each linear).
SLOPE_TOL = 0.01


@dataclass
class Mapping:
    """How PM samples were put on the host clock (:func:`map_batches`)."""

    slope: float  # host ns per CUPTI tick in the final domain
    pairs: int  # clock pairs that define it
    kept: int
    dropped: int  # samples decoded in another domain (before a profiler's timestamp callback)
    invalid: int  # samples in the domain with an impossible window (zero start, end before start)
    max_lag_ms: float  # longest decode lag among the kept samples


def map_batches(t0: np.ndarray, t1: np.ndarray, batches: list[dict], pairs: list[dict]) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, Mapping]:
    """Unix ns of each sample's start and end, a mask of the samples kept, and the mapping.

    CUPTI converts PM timestamps when it decodes them, into the domain its clock has at that
    moment: the GPU timer, or the domain of a timestamp callback a profiler registered (Kineto
    registers one, in TSC ticks). ``batches`` holds a (row_end, cupti_ns, unix_ns) pair taken
    after each decode; ``pairs`` the ones at start and stop. The last run of pairs with one
    slope defines the final domain (a least-squares line); a batch is kept when its pair lies in
    that run and its samples end before, and at most ``MAX_DECODE_LAG_NS`` before, the decode.
    """
    t0 = np.asarray(t0, dtype=np.float64)
    t1 = np.asarray(t1, dtype=np.float64)
    pts = [(0, float(p["cupti_ns"]), float(p["unix_ns"])) for p in pairs[:1]]
    pts += [(int(b["row_end"]), float(b["cupti_ns"]), float(b["unix_ns"])) for b in batches]
    pts += [(len(t0), float(p["cupti_ns"]), float(p["unix_ns"])) for p in pairs[1:]]
    if len(pts) < 2:
        raise ValueError("need two clock pairs to map PM samples")
    run = [len(pts) - 1]
    slope = None
    for i in range(len(pts) - 2, -1, -1):
        dc = pts[run[-1]][1] - pts[i][1]
        du = pts[run[-1]][2] - pts[i][2]
        if dc <= 0 or du <= 0:
            if slope is None and dc == 0:
                continue
            break
        s = du / dc
        if slope is None:
            slope = s
        elif abs(s / slope - 1.0) > SLOPE_TOL:
            break
        run.append(i)
    if slope is None or len(run) < 2:
        raise ValueError("no two clock pairs in one timestamp domain")
    c = np.array([pts[i][1] for i in run])
    u = np.array([pts[i][2] for i in run])
    s, a = np.polyfit(c - c.mean(), u, 1)
    u0 = a + s * (t0 - c.mean())
    u1 = a + s * (t1 - c.mean())
    keep = np.zeros(len(t0), dtype=bool)
    inrun = set(run)
    lag_max = 0.0
    prev = 0
    for i, (row_end, _c, uj) in enumerate(pts):
        row_end = min(row_end, len(t0))
        if row_end <= prev:
            continue
        if i in inrun:
            lag = uj - u1[prev:row_end]
            ok = (lag >= -1e6) & (lag <= MAX_DECODE_LAG_NS)
            keep[prev:row_end] = ok
            if ok.any():
                lag_max = max(lag_max, float(lag[ok].max()))
        prev = row_end
    dropped = int((~keep).sum())
    width = u1 - u0
    sane = (t0 > 0) & (width > 0)
    if (keep & sane).any():
        sane &= width <= MAX_WINDOW_RATIO * float(np.median(width[keep & sane]))
    invalid = int((keep & ~sane).sum())
    keep &= sane
    return u0, u1, keep, Mapping(float(s), len(run), int(keep.sum()), dropped, invalid, lag_max / 1e6)
