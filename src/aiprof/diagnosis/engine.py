"""The diagnosis: facts -> symptoms and causes -> priced, linked, ranked (docs/findings.md).

Per rank: build the facts once (with the replay graph, calibrated to the unprofiled step), run
every cause detector, price each cause by replaying the rank with its fix, link causes to the
symptoms they explain. Across ranks: the straggler's cause explains the others' waits.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.breakdown import StepBreakdown
from aiprof.analysis.comm import CommAnalysis
from aiprof.analysis.hotspots import Gaps, HostTree
from aiprof.analysis.kernels import KernelAnalysis
from aiprof.analysis.runtime import RuntimeAnalysis
from aiprof.analysis.steps import Steps
from aiprof.diagnosis import causes as registry
from aiprof.diagnosis.critical_path import leaf_table
from aiprof.diagnosis.detector import JobFacts, Scope
from aiprof.diagnosis.facts import CALIBRATION_TOL, RankFacts, calibrate_host, typical_step_ns
from aiprof.diagnosis.graph import RankCollectives, build_graph
from aiprof.diagnosis.job import JOINT_MAX_RANKS, job_step_ns, joint_replay, unprofiled_target_ns
from aiprof.diagnosis.model import (
    EXPOSED_COMM,
    GPU_IDLE,
    HEALTHY_MAX_SHARE,
    MIN_REPORTED_SHARE,
    SLOW_STEP,
    WAITING_RANK,
    Cause,
    Symptom,
    severity_of,
)
from aiprof.diagnosis.profiler_cost import DEFAULT, ProfilerCost
from aiprof.diagnosis.replay import Edit, ReplayResult, Trace, combine, gpu_floor_ns, replay
from aiprof.diagnosis.symptoms import completion_us, rank_symptoms, slow_step_mask
from aiprof.records import as_dict
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
# A cause explains a slow step when its fix saves at least this share of that step's extra time.
SLOW_STEP_EXPLAINED_SHARE = 0.5
# The replay covers at most this many consecutive steps (each replay walks every CUDA call of its
# window in Python: a 145-step, 3.4 M-event capture would take seconds per cause).
REPLAY_MAX_STEPS = 32
# A symptom left mostly unexplained (at least this share of the step) is shown on its own.
ORPHAN_MIN_SHARE = 0.05


def unprofiled_step_ms(rt: RankTrace) -> float | None:
    """The step time the agent measured just before this capture (no profiler), if recorded."""
    steps = (rt.meta.get("capture") or {}).get("steps") or {}
    v = steps.get("before_median_ms")
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


def compute_floor_ns(rt: RankTrace, g) -> float:
    """The mean step's GPU compute on its busiest stream (communication kernels left out: their
    recorded time includes waiting for other ranks). No step runs faster than its kernels do, so an
    unprofiled step measured below this was mistimed: the agent times iterations on the host, and a
    GPU-bound job's first iterations return while CUDA's launch queue fills (in the v3b pairs,
    16.95, 15.07, 14.40, 13.60, 19.17 ms, then 21.34-21.57 ms; unprofiled 21.67 ms, kernels 20.9 ms
    a step as captured). The calibration's target is raised to it."""
    if not g.n_ops or not len(rt.kernels):
        return 0.0
    comm = rt.kernels.strings("cls").isin_labels(lambda s: s == "communication")
    keep = np.ones(g.n_ops, dtype=bool)
    kern = g.o_table == 0
    keep[kern] = ~comm[g.o_row[kern]]
    if not keep.any():
        return 0.0
    busy = np.bincount(g.o_stream[keep].astype(np.int64) - int(g.o_stream.min()), weights=g.o_dur[keep])
    return float(busy.max()) / max(len(g.step_number), 1)


def replay_window(steps: Steps, breakdown: list[StepBreakdown]) -> slice:
    """The steps the replay covers: all of them up to REPLAY_MAX_STEPS, else that many
    consecutive steps around the slowest (so a stall is in it); savings per step come from them."""
    n = len(steps)
    if n <= REPLAY_MAX_STEPS:
        return slice(0, n)
    d = np.array([s.duration_us for s in breakdown]) if len(breakdown) == n else np.zeros(n)
    lo = int(np.clip(int(np.argmax(d)) - REPLAY_MAX_STEPS // 2, 0, n - REPLAY_MAX_STEPS))
    return slice(lo, lo + REPLAY_MAX_STEPS)


def rank_facts(rt: RankTrace, steps: Steps, breakdown: list[StepBreakdown], tree: HostTree, gaps: Gaps,
               runtime: RuntimeAnalysis, kernels: KernelAnalysis, comm: CommAnalysis, has_gpu: bool,
               host_idle_by_class: dict, profiler: ProfilerCost = DEFAULT,
               colls: RankCollectives | None = None, offset_ns: float = 0.0, settled: bool = False) -> RankFacts:
    """Assemble one rank's facts: the replay graph, deflated by the profiler's cost and scaled to
    the unprofiled step time where the capture knows it, and its baseline replay. With ``colls``
    (job.coupling) the graph waits at each collective for the others' recorded arrivals and is
    calibrated on its own (a job too large for the joint replay, analysed rank by rank).
    ``settled``: the caller settles the rank with a partner (job.settle), which fits the
    deflation and replays the baseline anew: the rank's own fit and baseline replay are skipped
    (``base`` stays None until then)."""
    sl = replay_window(steps, breakdown)
    g = build_graph(rt, Steps(steps.number[sl], steps.start[sl], steps.end[sl], steps.source), profiler, colls)
    n = max(len(steps), 1)
    recorded = float(sum(s.duration_us for s in breakdown)) * NS_PER_US / n if breakdown else 0.0
    un = unprofiled_step_ms(rt)
    if un and steps.within and steps.marker_mean_ns > 0 and len(steps):
        # the agent timed its own iterations (the marker steps these were split from): the
        # unprofiled time of one of these is that, in the recorded proportion
        un *= float((steps.end - steps.start).mean()) / steps.marker_mean_ns
    outliers = slow_step_mask(completion_us(rt, steps))[sl] if len(steps) else np.zeros(0, dtype=bool)
    if un:
        un = max(un, compute_floor_ns(rt, g) / 1e6)
    if settled:
        scale, base = (1.0, 1.0), None
    else:
        scale = calibrate_host(g, un * 1e6, outliers) if un and g.n_actions else (1.0, 1.0)
        base = replay(g, trace=Trace())  # traced: the critical path walks back through it
    return RankFacts(rt=rt, steps=steps, breakdown=breakdown, tree=tree, gaps=gaps, graph=g, base=base, runtime=runtime,
                     kernels=kernels, comm=comm, has_gpu=has_gpu, recorded_step_ns=recorded,
                     unprofiled_step_ns=un * 1e6 if un else None, host_scale=scale,
                     extra={"host_idle_by_class": host_idle_by_class, "outliers": outliers,
                            **({"offset_ns": offset_ns} if colls is not None else {})})


class Pricer:
    """Prices a cause's fix by replay: on its rank alone, or, for a job whose ranks are coupled
    by collectives, by the joint replay of every rank (the job's step is the slowest rank's).

    A saving is never more than what the unprofiled step can lose (:meth:`ceiling_ns`), and the
    causes of one rank are priced together (:meth:`price_jointly`): each reports its marginal
    saving, so that they add up to what fixing them all saves (docs/findings.md, "Pricing")."""

    def __init__(self, facts: list[RankFacts], coupled: bool, target_ns: float | None = None,
                 joint: dict[int, ReplayResult] | None = None) -> None:
        """``target_ns``: the job's unprofiled step its ranks were fitted to (job.settle), when
        the ranks in hand are not all of them (default: the median of theirs). ``joint``: the
        joint replay of ``facts`` as they are, when the caller has just made it (job.settle
        sets it as their baselines): not replayed again."""
        self.facts = facts
        self.coupled = coupled and len(facts) <= JOINT_MAX_RANKS
        self.target_ns = (target_ns or unprofiled_target_ns([f.unprofiled_step_ns for f in facts])) if coupled else None
        res = (joint if joint is not None else joint_replay(facts)) if self.coupled else {}
        self._job_base = job_step_ns(res)
        self._job_excess = unprofiled_excess_ns(facts, res, self.target_ns) if self.coupled else 0.0
        # (rank, the edits' ids) -> (the edits, saving ns, saving by step): the stand-alone and
        # the joint pricing replay the same sets of fixes (the edits are kept so no id is reused)
        self._memo: dict[tuple, tuple[tuple, float, np.ndarray]] = {}
        self._floor0: dict[int, float] = {}

    def _step(self, f: RankFacts, edit: Edit | None, others: dict | None = None) -> tuple[float, np.ndarray]:
        """Mean step with ``edit`` on ``f``'s rank (and ``others``' edits on theirs: a change made
        on every rank), the job's when coupled; and f's steps."""
        floor = edit.min_step_ns if edit is not None else 0.0
        if self.coupled:
            edits = dict(others or {})
            if edit is not None:
                edits[f.rank] = edit
            res = joint_replay(self.facts, edits or None)
            return max(job_step_ns(res), floor), res[f.rank].step_ns
        r = replay(f.graph, edit)
        return max(r.per_step_ns, floor), r.step_ns

    def base_step_ns(self, f: RankFacts) -> float:
        """The replayed step: the job's when coupled, else the rank's."""
        return self._job_base if self.coupled else f.base.per_step_ns

    def excess_ns(self, f: RankFacts) -> float:
        """What the replayed step exceeds the unprofiled one by (:func:`unprofiled_excess_ns`):
        time the job never spent, which no fix can win back; the job's when coupled."""
        return self._job_excess if self.coupled else unprofiled_excess_ns([f], {f.rank: f.base})

    def step_ns(self, f: RankFacts) -> float:
        """The step savings are taken from and are shares of: the replayed one less
        :meth:`excess_ns`."""
        return self.base_step_ns(f) - self.excess_ns(f)

    def ceiling_ns(self, f: RankFacts, edit: Edit | None, others: dict | None = None) -> float:
        """The most a fix can save per step (docs/findings.md, "Pricing"): :meth:`step_ns` less
        the GPU work the fix leaves on its busiest stream (:func:`gpu_floor_ns`; coupled, on the
        rank with the most: the job's step is its slowest rank's)."""
        ranks = self.facts if self.coupled else [f]
        edits = dict(others or {}) | ({f.rank: edit} if edit is not None else {})
        floor = max(self._floor_ns(q, edits.get(q.rank)) for q in ranks)
        return max(self.step_ns(f) - floor, 0.0)

    def _floor_ns(self, q: RankFacts, edit: Edit | None) -> float:
        """Rank q's GPU floor per step with ``edit`` (unedited: computed once per rank)."""
        if edit is not None:
            return gpu_floor_ns(q.graph, edit) / max(q.base.steps, 1)
        if q.rank not in self._floor0:
            self._floor0[q.rank] = gpu_floor_ns(q.graph) / max(q.base.steps, 1)
        return self._floor0[q.rank]

    def saved_ns(self, f: RankFacts, edits: list[Edit], others: dict | None = None) -> tuple[float, np.ndarray]:
        """What fixing ``edits`` together on f's rank (and ``others`` on theirs) saves per step,
        bounded by :meth:`ceiling_ns`; and by step (f's steps, scaled alike when bounded)."""
        key = (f.rank, tuple(id(e) for e in edits)) if others is None else None
        if key is not None and key in self._memo:
            return self._memo[key][1], self._memo[key][2]
        if not edits and not others:
            return 0.0, np.zeros(len(f.base.step_ns))
        edit = edits[0] if len(edits) == 1 else combine(f.graph, edits)
        fixed, fixed_steps = self._step(f, edit, others)
        by_step = (f.base.step_ns - fixed_steps) if len(f.base.step_ns) == len(fixed_steps) else np.zeros(0)
        save = max(self.base_step_ns(f) - fixed, 0.0)
        cap = self.ceiling_ns(f, edit, others)
        if save > cap:  # more than the unprofiled step has beyond the GPU's work left
            by_step = by_step * (cap / save)
            save = cap
        if key is not None:
            self._memo[key] = (tuple(edits), save, by_step)
        return save, by_step

    def price(self, f: RankFacts, c: Cause, given: list | None = None, others: dict | None = None) -> None:
        """The cause's saving: replayed step without its fix minus with it (bounded by
        :meth:`ceiling_ns`). With ``given`` (other causes' edits) the saving is marginal: what
        the fix still saves once those are fixed."""
        if c.edit is None:
            c.saving = {"method": "none", "per_step_us": 0.0, "share": 0.0, "total_us": 0.0,
                        "alone_us": 0.0, "alone_share": 0.0}
            return
        given = list(given or [])
        before, before_steps = self.saved_ns(f, given) if given else (0.0, np.zeros(0))
        after, after_steps = self.saved_ns(f, given + [c.edit], others)
        self._set(f, c, after - before, after, _diff(after_steps, before_steps), [e.label for e in given])
        c.saving["alone_us"], c.saving["alone_share"] = c.saving["per_step_us"], c.saving["share"]

    def bound_alone(self, f: RankFacts, c: Cause) -> None:
        """A generic cause is priced once the specific ones are fixed (:meth:`price` with
        ``given``). Where its fix saves less on the job as it is, it counts on those fixes (CUDA
        graphs gain more once per-tensor reads stop draining the GPU's queue): its stand-alone
        figure is then what it saves as the job is."""
        if c.edit is None or not c.saving.get("marginal_to"):
            return
        as_is, _ = self.saved_ns(f, [c.edit])
        if as_is / NS_PER_US < c.saving["alone_us"]:
            step = self.step_ns(f)
            c.saving["alone_us"], c.saving["alone_share"] = as_is / NS_PER_US, as_is / step if step > 0 else 0.0

    def price_jointly(self, f: RankFacts, ordered: list[Cause]) -> None:
        """Price the rank's causes together, in ``ordered``'s order: each one's saving becomes
        its marginal saving once the fixes before it are made (``marginal_to``), so the savings
        add up to what fixing them all saves; its stand-alone figure stays as ``alone_us``. A fix
        that adds nothing to those before it (or saves nothing alone) is left out of the sum."""
        prefix: list[Edit] = []
        labels: list[str] = []
        done, done_steps = 0.0, np.zeros(0)
        for c in ordered:
            if c.edit is None or c.saving.get("alone_us", 0.0) <= 0.0:
                continue
            alone = (c.saving["alone_us"], c.saving["alone_share"])
            now, now_steps = self.saved_ns(f, prefix + [c.edit])
            if now > done:
                self._set(f, c, now - done, now, _diff(now_steps, done_steps), list(labels))
                prefix.append(c.edit)
                labels.append(c.edit.label)
                done, done_steps = now, now_steps
            else:
                self._set(f, c, 0.0, done, np.zeros(0), list(labels))
            c.saving["alone_us"], c.saving["alone_share"] = alone

    def _set(self, f: RankFacts, c: Cause, save: float, together: float, by_step: np.ndarray,
             marginal_to: list[str]) -> None:
        """The cause's saving dict: ``save`` ns per step (marginal to ``marginal_to``: what the
        fix adds once those are made), ``together`` what all of them and it save."""
        ref_step = self.step_ns(f)
        save = max(save, 0.0)
        c.saving = {
            "method": "joint replay" if self.coupled else "replay",
            "per_step_us": save / NS_PER_US,
            "share": save / ref_step if ref_step > 0 else 0.0,
            "total_us": save * len(f.steps) / NS_PER_US,
            "marginal_to": marginal_to,
            "baseline_step_us": ref_step / NS_PER_US,
            # the step once this fix and those of marginal_to are made
            "fixed_step_us": (ref_step - together) / NS_PER_US,
            "recorded_step_us": f.recorded_step_ns / NS_PER_US,
            "unprofiled_step_us": f.unprofiled_step_ns / NS_PER_US if f.unprofiled_step_ns else None,
            "by_step_us": {int(s): float(v) / NS_PER_US for s, v in zip(f.graph.step_number, by_step)},
        }


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a - b`` by step, where ``b`` (a saving already counted) has the steps ``a`` has."""
    return a - b if len(a) == len(b) else a


def unprofiled_excess_ns(facts: list[RankFacts], res: dict, target_ns: float | None = None) -> float:
    """How much longer the replayed typical step (``res``: the ranks' baseline replays; the
    job's is its slowest rank's) is than the unprofiled step the agents measured (``target_ns``,
    default the median of the ranks that have one, as the calibration fits it), when the
    calibration could not deflate the recording that far (the GPU's recorded work alone is
    longer, say: ALPHA_MAX and MIN_HOST_SCALE reached). No fix can win that time back: the job
    never spent it. 0 without a measured step, and within the calibration's tolerance (there
    the replay is the measured step)."""
    target = target_ns or unprofiled_target_ns([f.unprofiled_step_ns for f in facts])
    if not target or not res:
        return 0.0
    typical = max(typical_step_ns(res[f.rank], f.extra.get("outliers")) for f in facts if f.rank in res)
    return typical - target if typical > target * (1 + CALIBRATION_TOL) else 0.0


def diagnose_rank(f: RankFacts, pricer: Pricer | None = None, coupled: bool = False,
                  asked: frozenset[str] | None = None) -> tuple[list[Cause], list[Symptom]]:
    """The registry's RANK detectors on one rank, and its UNCOUPLED ones when no collectives couple
    the job (``coupled`` False), each cause priced; and the rank's symptoms. ``asked``: the
    experimental codes to run (default: $AIPROF_EXPERIMENTAL_CAUSES)."""
    pricer = pricer or Pricer([f], False)
    found: list[Cause] = []
    claimed = np.zeros(len(f.tree), dtype=bool)
    # the host regions the causes found so far own (this array, growing): a GPU-side detector
    # leaves their kernels to the cause whose fix removes them
    f.extra["owned_nodes"] = claimed
    f.extra["found"] = found  # what the detectors found so far, for those that run last
    # in registry order across both scopes: an uncoupled detector sees the regions the rank
    # detectors before it claimed, and those after it see its own
    dets = registry.detectors((Scope.RANK,) if coupled else (Scope.RANK, Scope.UNCOUPLED), asked)
    generic: list[Cause] = []
    for det in sorted(dets, key=lambda d: d.last):
        if det.generic:
            f.extra["claimed_nodes"] = claimed
        for c in det.detect(f):
            # a generic remedy is priced once the specific causes are fixed: CUDA graphs would
            # also hide an unfused optimizer's launches, but fusing it is the fix for that
            pricer.price(f, c, [s.edit for s in found if s.edit is not None and s.rank == f.rank] if det.generic else None)
            if det.generic:
                pricer.bound_alone(f, c)
            found.append(c)
            if det.generic:
                generic.append(c)
            if c.region is not None and len(c.region) == len(claimed):
                claimed |= c.region
    pricer.price_jointly(f, joint_order(found, generic))
    return found, rank_symptoms(f)


def joint_order(found: list[Cause], generic: list[Cause]) -> list[Cause]:
    """The order a rank's causes are priced together in: the specific ones by what each saves
    alone, then the generic ones as they were found (each is a remedy for what the specific
    causes leave: it is priced once they are fixed, docs/findings.md "Pricing")."""
    gen = {id(c) for c in generic}
    specific = sorted((c for c in found if id(c) not in gen), key=lambda c: -c.saving.get("alone_us", 0.0))
    return specific + [c for c in found if id(c) in gen]


def rank_conditions(f: RankFacts, asked: frozenset[str] | None = None) -> dict[str, bool]:
    """Per JOB detector with a condition on every rank, whether this rank meets it (evaluated where
    the rank is analysed, shipped in its summary)."""
    return {d.code: d.every_rank(f) for d in registry.detectors(Scope.JOB, asked) if d.every_rank is not None}


def diagnose_job(job: JobFacts, conditions: list[dict[str, bool]] | None = None,
                 asked: frozenset[str] | None = None) -> list[Cause]:
    """The registry's JOB detectors on a coupled job, each pricing its cause. ``conditions``:
    every rank's :func:`rank_conditions` (default: those of the ranks in ``job``); a detector
    whose condition some rank does not meet is skipped."""
    if conditions is None:
        conditions = [rank_conditions(f, asked) for f in job.facts]
    out: list[Cause] = []
    for det in registry.detectors(Scope.JOB, asked):
        if det.every_rank is not None and not all(c.get(det.code, False) for c in conditions):
            continue
        out += det.detect(job)
    return out


def diagnose_cross(job: JobFacts, asked: frozenset[str] | None = None) -> tuple[list[Cause], list[Symptom]]:
    """The registry's CROSS_RANK detectors once the ranks are compared (``job.cross``): their
    symptoms and causes (a cause of ``job.found`` may be promoted in place)."""
    causes: list[Cause] = []
    symptoms: list[Symptom] = []
    for det in registry.detectors(Scope.CROSS_RANK, asked):
        if det.symptoms is not None:
            symptoms += det.symptoms(job)
        causes += det.detect(job)
    return causes, symptoms


def _link(causes: list[Cause], symptoms: list[Symptom]) -> None:
    """Attach each cause's claims to the symptoms; slow steps go to the causes whose fix saves
    most of the step's extra time."""
    by_key: dict[tuple, list[Symptom]] = {}
    for s in symptoms:
        by_key.setdefault((s.code, s.rank), []).append(s)
    for c in causes:
        for cl in c.claims:
            for s in by_key.get((cl.symptom, cl.rank), []):
                s.explained_by.append({"cause": c.id, "us": min(cl.us, s.us)})
        for s in by_key.get((SLOW_STEP, c.rank), []):
            by_step = c.saving.get("by_step_us") or {}
            # what the fix saves in the slow steps beyond what it saves in a typical step
            typical = float(np.median(list(by_step.values()))) if by_step else 0.0
            saved = sum(by_step.get(int(n), 0.0) - typical for n in s.detail["steps"])
            if saved >= SLOW_STEP_EXPLAINED_SHARE * s.us:
                # the cause explains the slow step (the replay prices it unprofiled, the symptom
                # is recorded time: the step counts as explained whole)
                s.explained_by.append({"cause": c.id, "us": s.us})
    for s in symptoms:
        s.unexplained_us = max(0.0, s.us - sum(e["us"] for e in s.explained_by))


def cause_dict(c: Cause) -> dict:
    """A cause as the report's JSON (edit and region are internal: not converted at all)."""
    return as_dict(c, exclude=("edit", "region"))


def baseline_entry(f: RankFacts, coupled: bool, pricer: Pricer | None = None) -> dict:
    """The report's ``baseline`` row of one rank: recorded, unprofiled and replayed step, what the
    replay was fitted to (``priced_from``), the replayed step less what it exceeds the
    unprofiled one by (``baseline_step_us``, what a saving on this rank is a share of; coupled,
    the job's step is its slowest rank's) and the most a fix that leaves the rank's GPU work as
    it is can save of it (``ceiling_us``), scales."""
    pricer = pricer or Pricer([f], False)
    # the ranks of a coupled job in hand are calibrated together (diagnosis.job.settle)
    jointly = coupled and len(pricer.facts) > 1
    measured = (bool(pricer.target_ns) or any(q.unprofiled_step_ns for q in pricer.facts)) if jointly \
        else bool(f.unprofiled_step_ns)
    # the rank's own replayed step (a coupled rank's, replayed with the others, ends with theirs)
    step = f.base.per_step_ns - pricer.excess_ns(f)
    return {"rank": f.rank, "recorded_step_us": f.recorded_step_ns / NS_PER_US,
            "unprofiled_step_us": f.unprofiled_step_ns / NS_PER_US if f.unprofiled_step_ns else None,
            # unprofiled: fitted to this rank's unprofiled step; job unprofiled: the coupled ranks
            # fitted together to the median of those they have; recording: no unprofiled step to
            # fit to, the profiler's cost removed by its per-event estimate
            "priced_from": ("job unprofiled" if jointly else "unprofiled") if measured else "recording",
            "replayed_step_us": f.base.per_step_ns / NS_PER_US,
            "baseline_step_us": step / NS_PER_US,
            "ceiling_us": max(step - gpu_floor_ns(f.graph) / max(f.base.steps, 1), 0.0) / NS_PER_US,
            "profiler_cost_scale": f.host_scale[0], "host_scale": f.host_scale[1],
            "profiler_cost_us": f.graph.deflated_ns / max(len(f.steps), 1) / NS_PER_US,
            "coupled": bool(coupled),
            "launch_latency_us": f.graph.launch_latency_ns / NS_PER_US,
            # where the replayed step's time goes, leaf by leaf (diagnosis/critical_path.py)
            "critical_path": leaf_table(f, f.extra.get("found", []))}


def assemble(causes: list[Cause], symptoms: list[Symptom], baseline: list[dict]) -> dict:
    """The report's ``causes``, ``symptoms`` and ``baseline`` from every rank's priced causes and
    symptoms (in rank order): causes below the report floor kept apart (``minor``), the others
    ranked by saving, numbered, linked to the symptoms they explain; and the one-line verdict. Needs no facts, so causes found on other machines assemble the same."""
    listed = [c.saving.get("share", 0.0) >= MIN_REPORTED_SHARE or bool(c.evidence.get("always_reported"))
              for c in causes]
    minor = sorted((c for c, ok in zip(causes, listed) if not ok), key=_rank_key)
    causes = sorted((c for c, ok in zip(causes, listed) if ok), key=_rank_key)
    for i, c in enumerate(causes):
        c.id = f"{c.code}@{'job' if c.rank is None else c.rank}#{i}"
        c.severity = severity_of(c.saving.get("share", 0.0))
    for i, c in enumerate(minor):
        c.id = f"{c.code}@{'job' if c.rank is None else c.rank}#minor{i}"
        c.severity = severity_of(c.saving.get("share", 0.0))
    for i, s in enumerate(symptoms):
        s.id = f"{s.code}@{'job' if s.rank is None else s.rank}#{i}"
    _link(causes, symptoms)
    by_id = {c.id: c for c in causes}
    for s in symptoms:
        for e in s.explained_by:
            by_id[e["cause"]].__dict__.setdefault("_symptoms", []).append(
                {"id": s.id, "code": s.code, "rank": s.rank, "title": s.title, "explained_us": e["us"],
                 "share": e["us"] / s.us * s.share if s.us else 0.0})
    out_causes = []
    for c in causes:
        d = cause_dict(c)
        d["symptoms"] = c.__dict__.get("_symptoms", [])
        out_causes.append(d)
    replayed = {b["rank"]: b.get("critical_path") or {} for b in baseline}
    out_symptoms = [as_dict(s) | {"orphan": s.unexplained_us / max(s.us, 1e-9) * s.share >= ORPHAN_MIN_SHARE
                                 and _replay_confirms(s, replayed.get(s.rank))}
                    for s in symptoms]
    return {"causes": out_causes,
            # below the report floor: kept for whoever wants them, not listed (docs/report.md)
            "minor": [cause_dict(c) | {"symptoms": []} for c in minor],
            "symptoms": out_symptoms,
            "verdict": verdict(out_causes, out_symptoms),
            "baseline": baseline}


# What each symptom is on the replayed (unprofiled) critical path: the share of it there.
_REPLAYED_SHARE = {GPU_IDLE: "loss_share", WAITING_RANK: "wait_share", EXPOSED_COMM: "comm_share"}


def _replay_confirms(s: Symptom, path: dict | None) -> bool:
    """Whether the unprofiled step still shows the symptom: idle time, waits and exposed
    communication seen only under the profiler (a rank whose host the profiler slowed makes the
    others wait in the recording, not in the replay) are no orphans. Other symptoms, and ranks
    without a replayed path, are taken as recorded."""
    key = _REPLAYED_SHARE.get(s.code)
    if key is None or not path or key not in path:
        return True
    return float(path[key]) >= ORPHAN_MIN_SHARE


def _rank_key(c: Cause) -> float:
    """Causes are ranked by what their fix saves per step over the replayed window: the window's
    total divided by its steps, so a stall in one step counts whole (its total), not as a share
    of the step it happened in. A fix that saves more once others are made (its marginal saving
    above what it saves alone) ranks by what it saves alone: it is not the first change to make."""
    sv = c.saving
    per = sv.get("per_step_us", 0.0)
    return -min(per, sv.get("alone_us", per))


def verdict(causes: list[dict], symptoms: list[dict]) -> dict:
    """The report's one-line answer: is anything worth fixing? Healthy when no cause's fix saves
    HEALTHY_MAX_SHARE of a step (docs/findings.md, "Ranking and severity")."""
    big = [c for c in causes if c["saving"].get("share", 0.0) >= HEALTHY_MAX_SHARE]
    orphans = sum(bool(s.get("orphan")) for s in symptoms)
    tail = f"; {orphans} symptom(s) no cause explains, below" if orphans else ""
    if big:
        c = big[0]
        who = "the job" if c["rank"] is None else f"rank {c['rank']}"
        return {"healthy": False, "causes": len(big),
                "line": f"{len(big)} cause(s) worth fixing; the first, {c['code']} on {who}, saves "
                        f"{100 * c['saving']['share']:.1f}% of a step{tail}"}
    low = (f" (the largest, {causes[0]['code']}, {100 * causes[0]['saving']['share']:.1f}%)" if causes else "")
    return {"healthy": True, "causes": 0,
            "line": f"Nothing to fix: no cause found would save {100 * HEALTHY_MAX_SHARE:.0f}% of a step"
                    f"{low}{tail}"}
