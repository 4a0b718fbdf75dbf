"""Facts about one rank, computed once and shared by every symptom and cause detector.

Detectors read these and never re-derive them: the analysed steps and their breakdown, the host
call tree and the GPU-idle gaps attributed to it, the runtime and kernel analyses, the replay
graph and its baseline replay calibrated to the unprofiled step time where the capture knows it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiprof.analysis.breakdown import StepBreakdown
from aiprof.analysis.comm import CommAnalysis
from aiprof.analysis.hotspots import Gaps, HostTree
from aiprof.analysis.intervals import Union, union
from aiprof.analysis.kernels import KernelAnalysis
from aiprof.analysis.runtime import RuntimeAnalysis
from aiprof.analysis.steps import Steps
from aiprof.diagnosis.graph import Graph
from aiprof.diagnosis.replay import Edit, ReplayResult, replay
from aiprof.trace.store import RankTrace

# Host-time scale search (see calibrate_host): the replay is matched to the measured unprofiled
# step within this relative tolerance, in at most this many bisection rounds.
CALIBRATION_TOL = 0.01
CALIBRATION_ROUNDS = 24
# The uniform host scale never goes below this: a capture whose GPU part alone exceeds the
# measured step was taken under different conditions (other load, clocks).
MIN_HOST_SCALE = 0.05
# The per-event profiler cost is scaled at most this much: beyond it the remaining inflation has
# no recorded events to show for it and is taken as uniform.
ALPHA_MAX = 10.0
# A replay faster than the unprofiled step gets host time back (less deflation) only if that
# moves its step by at least this share: less is within the step-to-step variation of the jobs
# these captures come from (a comm-bound FSDP1 job over sockets, four captures: its replay moved
# 3 % between no deflation and the measured cost, its unprofiled steps varied 97-110 ms), and
# fitting it made the host the bound of every what-if (docs/findings.md, "Profiler inflation").
HOST_BOUND_MIN_SHARE = 0.05


@dataclass
class RankFacts:
    """Everything the diagnosis knows about one rank (built by :func:`rank_facts`)."""

    rt: RankTrace
    steps: Steps
    breakdown: list[StepBreakdown]
    tree: HostTree
    gaps: Gaps
    graph: Graph
    base: ReplayResult  # the unedited replay (deflated, calibrated)
    runtime: RuntimeAnalysis
    kernels: KernelAnalysis
    comm: CommAnalysis
    has_gpu: bool
    recorded_step_ns: float  # mean step of the capture as recorded (profiled)
    unprofiled_step_ns: float | None  # measured before the capture by the agent, if known
    host_scale: tuple  # (alpha, beta) fitted so the replay matches the unprofiled step ((1, 1): none)
    extra: dict = field(default_factory=dict)  # cross-rank context, filled by the engine
    counters: Any = None  # analysis.counters.CounterAnalysis: the GPU's PM counters, None without them

    @property
    def rank(self) -> int:
        return self.rt.rank

    @property
    def n_steps(self) -> int:
        return max(len(self.steps), 1)

    @property
    def step_ns(self) -> float:
        """The step time savings are a share of: the replayed (unprofiled) mean step."""
        return self.base.per_step_ns

    # ------------------------------------------------------------------ shared region helpers
    def node_mask(self, pred: Callable[[str], bool], kinds: tuple[int, ...] | None = None) -> np.ndarray:
        """Tree nodes whose name satisfies ``pred`` (and whose kind is in ``kinds``)."""
        memo = self.extra.setdefault("_label_masks", {})
        key = (pred, kinds)
        if key not in memo:
            ok = np.array([bool(pred(s)) for s in self.tree.labels] + [False], dtype=bool)
            m = ok[self.tree.code] if len(self.tree) else np.zeros(0, dtype=bool)
            if kinds is not None and len(m):
                m &= self._kind_mask(kinds)
            memo[key] = m
        return memo[key]

    def _kind_mask(self, kinds: tuple[int, ...]) -> np.ndarray:
        """Tree nodes whose kind is in ``kinds``; cached: detectors ask for a few kinds hundreds
        of times (node_mask's keys are their predicates)."""
        memo = self.extra.setdefault("_kind_masks", {})
        if kinds not in memo:
            memo[kinds] = np.isin(self.tree.kind, kinds)
        return memo[kinds]

    def under(self, roots: np.ndarray) -> np.ndarray:
        """Nodes that are, or descend from, a node in the mask ``roots`` (one vectorised pass
        per tree depth: a node's parent is always one level up)."""
        hit = roots.copy()
        if not len(hit) or not hit.any():
            return hit
        for idx in self._by_depth():
            p = self.tree.parent[idx]
            hit[idx] |= hit[p]
        return hit

    def _by_depth(self) -> list[np.ndarray]:
        """Node indices of each depth >= 1, shallowest first (cached)."""
        if "_by_depth" not in self.extra:
            d = self.tree.depth
            order = np.argsort(d, kind="stable")
            ds = d[order]
            cuts = np.searchsorted(ds, np.arange(1, int(ds.max()) + 2)) if len(ds) else np.zeros(0, np.int64)
            self.extra["_by_depth"] = [order[cuts[k]:cuts[k + 1]] for k in range(len(cuts) - 1)
                                       if cuts[k + 1] > cuts[k]]
        return self.extra["_by_depth"]

    def action_nodes(self) -> np.ndarray:
        """Tree node of each replay action (-1 for markers and calls outside the tree)."""
        g = self.graph
        if "_action_nodes" not in self.extra:
            out = np.full(g.n_actions, -1, np.int64)
            real = g.a_row >= 0
            if len(self.tree.runtime_node):
                out[real] = self.tree.runtime_node[g.a_row[real]]
            self.extra["_action_nodes"] = out
        return self.extra["_action_nodes"]

    def actions_in(self, node_mask: np.ndarray) -> np.ndarray:
        """Replay actions whose call lies inside a node of ``node_mask`` (the mask from :meth:`under`)."""
        nodes = self.action_nodes()
        out = np.zeros(len(nodes), dtype=bool)
        ok = nodes >= 0
        if len(node_mask):
            out[ok] = node_mask[nodes[ok]]
        return out

    def union_of_nodes(self, node_mask: np.ndarray) -> Union:
        """Time union of the given nodes' intervals."""
        return union(self.tree.start[node_mask], self.tree.end[node_mask])

    def gap_time_in(self, u: Union) -> np.ndarray:
        """Per replay action: the replayed (deflated, calibrated) host ns of the gap before it
        that lies inside ``u`` (the recorded overlap, scaled like the gap)."""
        g = self.graph
        start = np.concatenate([[g.lo], np.maximum.accumulate(g.a_end)[:-1]])
        raw = np.maximum(g.a_ts - start, 0)
        cov = u.covered(start, np.maximum(g.a_ts, start)).astype(np.float64)
        ratio = np.divide(np.maximum(g.gap, 0), raw, out=np.zeros(len(raw)), where=raw > 0)
        return cov * ratio

    def edit(self, label: str) -> Edit:
        return Edit.for_graph(self.graph, label)

    def price(self, edit: Edit) -> ReplayResult:
        return replay(self.graph, edit)


def typical_step_ns(r: ReplayResult, outliers: np.ndarray | None = None) -> float:
    """The replayed mean step without the extra time of the recorded outlier steps: what the
    agent's median of the iterations before the capture measured (a stall inside the captured
    window is not in it)."""
    if outliers is None or not outliers.any() or len(r.step_ns) != len(outliers):
        return r.per_step_ns
    med = float(np.median(r.step_ns[~outliers])) if (~outliers).any() else float(np.median(r.step_ns))
    extra = float(np.maximum(r.step_ns[outliers] - med, 0).sum())
    return (r.total_ns - extra) / max(r.steps, 1)


def calibrate_host(g: Graph, target_step_ns: float, outliers: np.ndarray | None = None) -> tuple[float, float]:
    """Fit the graph's profiler deflation (in place) so that its replay's typical step matches
    ``target_step_ns``; returns (alpha, beta) (see :meth:`Graph.deflate`)."""
    def at(alpha: float, beta: float) -> float:
        g.deflate(alpha, beta)
        return typical_step_ns(replay(g), outliers)

    return fit_deflation(at, target_step_ns)


def fit_deflation(at: Callable[[float, float], float], target: float) -> tuple[float, float]:
    """Fit (alpha, beta) so that ``at(alpha, beta)`` (the replayed step; non-increasing in alpha,
    non-decreasing in beta) meets ``target``. First the per-event profiler cost is scaled (alpha:
    the inflation sits where events were recorded, and a sleep or an I/O wait is not inflated),
    then, if that is not enough (inflation with no events to show for it, as in compiled code) or
    too much, all host time uniformly (beta). Deflation is lowered only where the host sets the
    step (HOST_BOUND_MIN_SHARE). ``at`` leaves the graphs in the state it was last
    called with; this returns with the fitted state applied."""
    def close(v: float) -> bool:
        return abs(v - target) <= CALIBRATION_TOL * target

    v1 = at(1.0, 1.0)
    if close(v1):
        return 1.0, 1.0
    if v1 > target:  # more deflation: alpha up to ALPHA_MAX, then beta down
        if at(ALPHA_MAX, 1.0) <= target:
            a = _bisect(lambda x: at(x, 1.0), 1.0, ALPHA_MAX, target, decreasing=True)
            return a, 1.0
        if at(ALPHA_MAX, MIN_HOST_SCALE) > target:
            return ALPHA_MAX, MIN_HOST_SCALE  # GPU-bound beyond the target (documented limit)
        b = _bisect(lambda x: at(ALPHA_MAX, x), MIN_HOST_SCALE, 1.0, target, decreasing=False)
        return ALPHA_MAX, b
    # less deflation (the replay is faster than the unprofiled job with the measured per-event
    # cost removed): alpha down to 0, then beta up; only where the host sets the step. If putting
    # all of the profiler's cost back moves the step by under HOST_BOUND_MIN_SHARE, the GPU or
    # the collectives set it and the miss is theirs: the measured cost stays (host time added to
    # fit would be host time no fix can remove, and would cap every fix of the GPU's side)
    v0 = at(0.0, 1.0)
    if v0 - v1 < HOST_BOUND_MIN_SHARE * target:
        at(1.0, 1.0)
        return 1.0, 1.0
    if v0 >= target:
        a = _bisect(lambda x: at(x, 1.0), 0.0, 1.0, target, decreasing=True)
        return a, 1.0
    b = _bisect(lambda x: at(0.0, x), 1.0, 1.0 / MIN_HOST_SCALE, target, decreasing=False)
    return 0.0, b


def _bisect(fn: Callable[[float], float], lo: float, hi: float, target: float, decreasing: bool) -> float:
    """x in [lo, hi] with fn(x) ~ target for a monotone fn; leaves fn applied at the result."""
    x = 0.5 * (lo + hi)
    for _ in range(CALIBRATION_ROUNDS):
        x = 0.5 * (lo + hi)
        v = fn(x)
        if abs(v - target) <= CALIBRATION_TOL * target:
            break
        if (v > target) == decreasing:
            lo = x
        else:
            hi = x
    fn(x)
    return x
