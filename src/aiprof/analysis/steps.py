"""Iterations ("steps") of a rank's trace. Definitions in docs/metrics.md ("Steps").

Sources, in order of preference:
1. ``ProfilerStep#N`` annotations (torch.profiler's schedule, or aiprof's agent);
2. ``Optimizer.step#...`` annotations: a trace captured mid-run by an optimizer hook has these
   and no ProfilerStep; step i runs from the end of optimizer step i-1 to the end of step i;
3. a configured entry function (a Python function / annotation / op name): each top-level
   occurrence is a step; it takes precedence over everything else;
4. otherwise the repeating unit found automatically (analysis/iterations.py: an engine's step
   function, the top-level module's forwards, the period of the op or kernel sequence, GPU
   bursts);
5. otherwise the whole window is one step.

Inference traces (no backward pass) whose ProfilerSteps each hold several engine steps or
top-level module forwards (a ``generate`` call per ProfilerStep) are split into those: one
iteration per forward, i.e. per generated token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis import iterations
from aiprof.analysis.memo import analysis_cache
from aiprof.trace.store import RankTrace

_PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
# ProfilerSteps are split into the units they hold when the median step holds at least this many.
SPLIT_MIN_UNITS_PER_STEP = 2


@dataclass(frozen=True)
class Steps:
    """Step windows on the host clock (ns); ``number`` is the step's id in the trace."""

    number: np.ndarray
    start: np.ndarray
    end: np.ndarray
    source: str  # "ProfilerStep", "optimizer", "entry:<name>", "engine:<fn>", "module:<name>", "ops:<op>",
    # "kernels:<kernel>", "gpu-bursts", "window" (docs/metrics.md, "Steps")
    within: str = ""  # the marker steps the iterations were split from ("ProfilerStep"), if any
    marker_mean_ns: float = 0.0  # their mean duration: what the agent's per-iteration timings measure

    def __len__(self) -> int:
        return len(self.number)

    def index_of(self, ts: np.ndarray) -> np.ndarray:
        """Step index (0..n-1) containing each timestamp, or -1 when outside every step."""
        ts = np.asarray(ts, dtype=np.int64)
        i = np.searchsorted(self.start, ts, side="right") - 1
        ok = (i >= 0) & (ts < npx.take(self.end, i, 0))
        return np.where(ok, i, -1)


def window(rt: RankTrace) -> tuple[int, int]:
    """First and last instant of any host or GPU event of the rank (ns)."""
    lo, hi = [], []
    for name in ("ops", "annotations", "python", "runtime", "kernels", "memops"):
        t = rt.table(name)
        if len(t):
            lo.append(int(t["ts"].min()))
            hi.append(int((t["ts"] + t["dur"]).max()))
    if not lo:
        return (0, 0)
    return (min(lo), max(hi))


def _host_annotations(rt: RankTrace):
    a = rt.annotations
    if not len(a):
        return None
    return a.take(~a["gpu"])


def find_steps(rt: RankTrace, entry: str | None = None) -> Steps:
    """Find the rank's iterations; ``entry`` names a function/annotation marking one step
    (cached on the rank: every analysis asks)."""
    cache = analysis_cache(rt)
    key = ("steps", entry or "")
    if key not in cache:
        cache[key] = _find_steps(rt, entry)
    return cache[key]


def _find_steps(rt: RankTrace, entry: str | None) -> Steps:
    ann = _host_annotations(rt)
    if entry:
        st = _entry_steps(rt, entry)
        if st is not None:
            return st
    if ann is not None and len(ann):
        names = ann.strings("name")
        num_of = np.full(len(names.labels) + 1, -1, dtype=np.int64)
        for i, s in enumerate(names.labels):
            m = _PROFILER_STEP.match(s)
            if m:
                num_of[i] = int(m.group(1))
        nums = num_of[names.codes]
        sel = nums >= 0
        if sel.any():
            order = np.argsort(ann["ts"][sel], kind="stable")
            ts, dur = ann["ts"][sel][order], ann["dur"][sel][order]
            marked = Steps(nums[sel][order], ts, ts + dur, "ProfilerStep")
            return _split_marked(rt, marked) or marked
        opt = names.isin_labels(lambda s: s.startswith("Optimizer.step#"))
        if opt.any():
            ends = np.sort((ann["ts"] + ann["dur"])[opt])
            lo, _ = window(rt)
            starts = np.concatenate([[lo], ends[:-1]])
            return Steps(np.arange(len(ends)), starts, ends, "optimizer")
    lo, hi = window(rt)
    u = iterations.find_units(rt)
    if u is not None:
        s, e = iterations.iteration_windows(u, lo, hi + 1)
        if len(s) >= iterations.MIN_UNITS:
            return Steps(np.arange(len(s)), s, e, u.source)
    return Steps(np.array([0]), np.array([lo], dtype=np.int64), np.array([hi], dtype=np.int64), "window")


def _split_marked(rt: RankTrace, marked: Steps) -> Steps | None:
    """Inference ProfilerSteps that each hold several engine steps or model forwards, split into
    those (the first iteration of a step starts with the step: the request's set-up is in it)."""
    if iterations.has_backward(rt):
        return None
    u = iterations.find_units(rt, ("engine", "module"))
    if u is None:
        return None
    per = np.bincount(np.maximum(marked.index_of(u.start), 0), minlength=len(marked))
    if float(np.median(per)) < SPLIT_MIN_UNITS_PER_STEP:
        return None
    starts, ends = [], []
    for a, b in zip(marked.start.tolist(), marked.end.tolist()):
        s, e = iterations.iteration_windows(u, a, b)
        if len(s):
            s = s.copy()
            s[0] = a
            starts.append(s)
            ends.append(e)
    if not starts:
        return None
    s, e = np.concatenate(starts), np.concatenate(ends)
    return Steps(np.arange(len(s)), s, e, u.source, within=marked.source,
                 marker_mean_ns=float((marked.end - marked.start).mean()))


def _entry_steps(rt: RankTrace, entry: str) -> Steps | None:
    """Top-level occurrences of ``entry`` among Python frames, annotations and ops."""
    best = None
    for name in ("python", "annotations", "ops"):
        t = rt.table(name)
        if not len(t):
            continue
        mask = t.strings("name").isin_labels(lambda s: s == entry or s.endswith(": " + entry) or entry in s)
        if not mask.any():
            continue
        ts, end = t["ts"][mask], (t["ts"] + t["dur"])[mask]
        order = np.argsort(ts, kind="stable")
        ts, end = ts[order], end[order]
        # drop nested occurrences (recursion, wrappers): keep those starting after the last end
        keep, reach = [], -1
        for k in range(len(ts)):
            if ts[k] >= reach:
                keep.append(k)
                reach = end[k]
        idx = np.array(keep)
        best = Steps(np.arange(len(idx)), ts[idx], end[idx], f"entry:{entry}")
        break
    return best
