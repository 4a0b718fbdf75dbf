"""The diagnosis: facts -> symptoms and causes -> priced, linked, ranked (docs/findings.md).

Per rank: build the facts once (with the replay graph, calibrated to the unprofiled step), run
every cause detector, price each cause by replaying the rank with its fix, link causes to the
symptoms they explain. Across ranks: the straggler's cause explains the others' waits.
"""
from __future__ import annotations

from dataclasses import asdict

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
from aiprof.diagnosis.facts import RankFacts, calibrate_host
from aiprof.diagnosis.graph import RankCollectives, build_graph
from aiprof.diagnosis.job import JOINT_MAX_RANKS, job_step_ns, joint_replay
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
from aiprof.diagnosis.replay import Edit, Trace, combine, replay
from aiprof.diagnosis.symptoms import completion_us, rank_symptoms, slow_step_mask
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
               colls: RankCollectives | None = None, offset_ns: float = 0.0) -> RankFacts:
    """Assemble one rank's facts: the replay graph, deflated by the profiler's cost and scaled to
    the unprofiled step time where the capture knows it, and its baseline replay. With ``colls``
    (job.coupling) the graph waits at each collective for the others' recorded arrivals and is
    calibrated on its own (a job too large for the joint replay, analysed rank by rank)."""
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
    scale = calibrate_host(g, un * 1e6, outliers) if un and g.n_actions else (1.0, 1.0)
    base = replay(g, trace=Trace())  # traced: the critical path walks back through it
    return RankFacts(rt=rt, steps=steps, breakdown=breakdown, tree=tree, gaps=gaps, graph=g, base=base, runtime=runtime,
                     kernels=kernels, comm=comm, has_gpu=has_gpu, recorded_step_ns=recorded,
                     unprofiled_step_ns=un * 1e6 if un else None, host_scale=scale,
                     extra={"host_idle_by_class": host_idle_by_class, "outliers": outliers,
                            **({"offset_ns": offset_ns} if colls is not None else {})})


class Pricer:
    """Prices a cause's fix by replay: on its rank alone, or, for a job whose ranks are coupled
    by collectives, by the joint replay of every rank (the job's step is the slowest rank's)."""

    def __init__(self, facts: list[RankFacts], coupled: bool) -> None:
        self.facts = facts
        self.coupled = coupled and len(facts) <= JOINT_MAX_RANKS
        self._job_base = job_step_ns(joint_replay(facts)) if self.coupled else 0.0

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

    def price(self, f: RankFacts, c: Cause, given: list | None = None, others: dict | None = None) -> None:
        """The cause's saving: replayed step without its fix minus with it. With ``given`` (other
        causes' edits) the saving is marginal: what the fix still saves once those are fixed."""
        if c.edit is None:
            c.saving = {"method": "none", "per_step_us": 0.0, "share": 0.0, "total_us": 0.0}
            return
        ref_step = self._job_base if self.coupled else f.base.per_step_ns
        base_step, base_steps = ref_step, f.base.step_ns
        edit = c.edit
        if given:
            prior = combine(f.graph, given)
            base_step, base_steps = self._step(f, prior)
            edit = combine(f.graph, given + [c.edit])
        fixed, fixed_steps = self._step(f, edit, others)
        save = max(base_step - fixed, 0.0)
        by_step = (base_steps - fixed_steps) if len(base_steps) == len(fixed_steps) else np.zeros(0)
        c.saving = {
            "method": "joint replay" if self.coupled else "replay",
            "per_step_us": save / NS_PER_US,
            "share": save / ref_step if ref_step > 0 else 0.0,
            "total_us": save * len(f.steps) / NS_PER_US,
            "marginal_to": [e.label for e in given] if given else [],
            "baseline_step_us": ref_step / NS_PER_US,
            "fixed_step_us": (ref_step - save) / NS_PER_US,
            "recorded_step_us": f.recorded_step_ns / NS_PER_US,
            "unprofiled_step_us": f.unprofiled_step_ns / NS_PER_US if f.unprofiled_step_ns else None,
            "by_step_us": {int(s): float(v) / NS_PER_US for s, v in zip(f.graph.step_number, by_step)},
        }


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
    dets = registry.detectors(Scope.RANK, asked) + (() if coupled else registry.detectors(Scope.UNCOUPLED, asked))
    for det in sorted(dets, key=lambda d: d.last):
        if det.generic:
            f.extra["claimed_nodes"] = claimed
        for c in det.detect(f):
            # a generic remedy is priced once the specific causes are fixed: CUDA graphs would
            # also hide an unfused optimizer's launches, but fusing it is the fix for that
            pricer.price(f, c, [s.edit for s in found if s.edit is not None and s.rank == f.rank] if det.generic else None)
            found.append(c)
            if c.region is not None and len(c.region) == len(claimed):
                claimed |= c.region
    return found, rank_symptoms(f)


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
    """A cause as the report's JSON (edit and region are internal)."""
    d = {k: v for k, v in asdict(c).items() if k not in ("edit", "region")}
    return d


def baseline_entry(f: RankFacts, coupled: bool) -> dict:
    """The report's ``baseline`` row of one rank: recorded, unprofiled and replayed step, scales."""
    return {"rank": f.rank, "recorded_step_us": f.recorded_step_ns / NS_PER_US,
            "unprofiled_step_us": f.unprofiled_step_ns / NS_PER_US if f.unprofiled_step_ns else None,
            "replayed_step_us": f.base.per_step_ns / NS_PER_US,
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
    out_symptoms = [asdict(s) | {"orphan": s.unexplained_us / max(s.us, 1e-9) * s.share >= ORPHAN_MIN_SHARE
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
    of the step it happened in."""
    return -c.saving.get("per_step_us", 0.0)


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
