"""Symptoms of one rank: what the numbers show, before any cause is known (docs/findings.md).

All amounts are recorded (profiled) time over the analysed steps; shares are of the recorded
step time, so they match the breakdown the report shows next to them.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.launch import launch_ts
from aiprof.analysis.steps import Steps
from aiprof.diagnosis.facts import RankFacts
from aiprof.trace.store import RankTrace
from aiprof.diagnosis.model import (
    EXPOSED_COMM,
    EXPOSED_COPY,
    GPU_IDLE,
    SLOW_KERNELS,
    SLOW_STEP,
    Symptom,
)

NS_PER_US = 1000.0
# A symptom smaller than this share of the step is not worth a line.
MIN_SHARE = 0.01
# SLOW_STEP: a step this much slower than the median (ratio and absolute), beyond this many
# median absolute deviations (so noisy steady steps do not qualify), with at least 3 steps; durations from completion to
# completion (see completion_us).
SLOW_STEP_MIN_STEPS = 3
SLOW_STEP_RATIO = 1.3
SLOW_STEP_MIN_US = 5_000.0
SLOW_STEP_MAD_K = 5.0
SLOW_STEP_MAX_SEPARATE = 3  # more slow steps than this are one recurring symptom


def _fmt(us: float) -> str:
    return f"{us / 1000.0:.1f} ms"


def completion_us(rt: RankTrace, steps: Steps) -> np.ndarray:
    """Each step's duration from one step's completion to the next (µs): a step completes when
    both its host window and the GPU work it launched are done. In a loop that never waits for
    the GPU the host runs ahead and its step windows say nothing of the GPU's pace (the last
    window then absorbs the backlog); completions do."""
    n = len(steps)
    if not n:
        return np.zeros(0)
    done = steps.end.astype(np.float64).copy()
    for name in ("kernels", "memops"):
        g = rt.table(name)
        if not len(g):
            continue
        i = steps.index_of(launch_ts(rt.runtime, g))
        ok = i >= 0
        np.maximum.at(done, i[ok], (g["ts"] + g["dur"])[ok].astype(np.float64))
    done = np.maximum.accumulate(done)
    prev = np.concatenate([[float(steps.start[0])], done[:-1]])
    return (done - prev) / NS_PER_US


def slow_step_mask(d: np.ndarray) -> np.ndarray:
    """Steps slow by the SLOW_STEP rule (``d``: step durations, µs): >= 1.3x the median and
    >= 5 ms longer, beyond 5 median absolute deviations, with at least 3 steps."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) < SLOW_STEP_MIN_STEPS:
        return np.zeros(len(d), dtype=bool)
    med = float(np.median(d))
    mad = float(np.median(np.abs(d - med)))
    return (d >= SLOW_STEP_RATIO * med) & (d - med >= SLOW_STEP_MIN_US) & (d - med >= SLOW_STEP_MAD_K * mad)


def rank_symptoms(f: RankFacts) -> list[Symptom]:
    """GPU idle, exposed communication, exposed copies, slow matmuls and slow steps of a rank."""
    out: list[Symptom] = []
    steps = f.breakdown
    if not steps:
        return out
    n = len(steps)
    total = float(sum(s.duration_us for s in steps)) or 1.0

    def add(code: str, us: float, title: str, detail: dict) -> None:
        if us / total >= MIN_SHARE:
            out.append(Symptom(code, f.rank, title, us, us / n, us / total, detail))

    if f.has_gpu:
        idle = float(sum(s.idle_us for s in steps))
        by_class = {c: v for c, v in f.extra.get("host_idle_by_class", {}).items() if v > 0}
        add(GPU_IDLE, idle, f"GPU idle {_fmt(idle / n)} per step ({100 * idle / total:.0f}% of the step)",
            {"by_host_class_us": by_class})
        comm = float(sum(s.communication_us for s in steps))
        add(EXPOSED_COMM, comm, f"{_fmt(comm / n)} per step of communication not hidden behind compute "
            f"({100 * comm / total:.0f}%)", {"by_type": f.comm.by_type})
        mem = float(sum(s.memory_us for s in steps))
        add(EXPOSED_COPY, mem, f"{_fmt(mem / n)} per step of memory copies not hidden behind compute "
            f"({100 * mem / total:.0f}%)", {})
        slow_mm = float(f.kernels.non_tc_matmul_us)
        add(SLOW_KERNELS, slow_mm, f"{_fmt(slow_mm / n)} per step of matrix products without tensor cores", {})
    d = completion_us(f.rt, f.steps) if len(f.steps) == n else np.array([s.duration_us for s in steps])
    if n >= SLOW_STEP_MIN_STEPS:
        med = float(np.median(d))
        mask = slow_step_mask(d)
        slow = [(s, float(x)) for s, x, m in zip(steps, d, mask) if m]
        if len(slow) > SLOW_STEP_MAX_SEPARATE:
            # a recurring slow step (every Nth: checkpointing, evaluation, a periodic stall) is one problem
            nums = [s.step for s, _ in slow]
            gaps = set(np.diff(nums).tolist())
            period = f", every {gaps.pop()} steps" if len(gaps) == 1 else ""
            extra = float(sum(x - med for _, x in slow))
            worst, wd = max(slow, key=lambda sx: sx[1])
            out.append(Symptom(SLOW_STEP, f.rank, f"{len(slow)} of {n} steps are slow{period}; the worst, step "
                               f"{worst.step}, took {_fmt(wd)}, {wd / med:.2f}x the median {_fmt(med)}", extra,
                               extra / n, extra / total,
                               {"steps": nums, "step": worst.step, "step_us": wd, "median_us": med}))
        else:
            for s, x in slow:
                extra = x - med
                out.append(Symptom(SLOW_STEP, f.rank, f"step {s.step} took {_fmt(x)}, {x / med:.2f}x the median "
                                   f"{_fmt(med)}", extra, extra / n, extra / total,
                                   {"steps": [s.step], "step": s.step, "step_us": x, "median_us": med}))
    return out
