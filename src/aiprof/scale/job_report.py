"""The driver of a scaled-out analysis: per-rank tasks on an engine, the report from summaries.

1. **Ingest** (one task per trace file): the rank's store, its collectives.
2. **Match** (driver): the collectives across ranks, clock offsets, arrivals
   (analysis.ranks.align_and_arrivals) and each rank's coupling (diagnosis.job.coupling).
3. **Analyse** (one task per rank): the rank's report section, its causes priced on its own
   replay (waiting at collectives for the others' recorded arrivals), its symptoms
   (aiprof.pipeline's rank stages; the lowest rank also runs its job stage).
4. **Compare** (driver): stragglers and abnormal workers from the summaries
   (analysis.ranks.cross_rank_of).
5. **Stragglers** (one task each, on the straggler and its base rank): the diff evidence and
   the straggler's cause.
6. **Assemble** (driver): causes ranked and linked to symptoms (diagnosis.engine.assemble,
   pipeline.assemble).
7. **Tables** (one task per rank the report keeps whole, above pipeline.DETAIL_RANKS ranks):
   the rank's section with its tables, which step 3 left out (pipeline.detail_ranks).

The driver holds the summaries only: each rank's report section (tens of kB), its collectives'
times and its causes and symptoms. The report has the same schema as the in-process one.
"""
from __future__ import annotations

import contextlib
import gc
import time
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from aiprof import pipeline
from aiprof.analysis.breakdown import StepBreakdown
from aiprof.analysis.ranks import align_and_arrivals, cross_rank_of
from aiprof.analysis.report import RankReport
from aiprof.diagnosis.causes import experimental_asked
from aiprof.diagnosis.engine import assemble
from aiprof.diagnosis.job import JOINT_MAX_RANKS, coupling, unprofiled_target_ns
from aiprof.errors import TraceError
from aiprof.records import as_dict
from aiprof.scale import tasks
from aiprof.scale.engines import Progress, RayEngine, SerialEngine
from aiprof.scale.results import Call, run_phase
from aiprof.trace.store import Capture


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic garbage collection during one of the driver's own steps. A step builds
    hundreds of thousands of small dicts and lists and frees hardly any, and each collection of
    the oldest generation walks every object the driver holds (every rank's summary) to find
    nothing: with 1,024 ddp2 ranks (bench/driver_ab.py), matching, comparing and assembling took
    0.38 s paused, 0.49 s not. Whatever garbage a step leaves goes at the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _step(clock: dict[str, float], name: str) -> Iterator[None]:
    """One of the driver's own steps: collection paused (_gc_paused), its wall seconds added to
    ``clock[name]``."""
    with _gc_paused():
        t = time.perf_counter()
        try:
            yield
        finally:
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t


def _rank_view(d: dict) -> RankReport:
    """A RankReport over a report dict, as the cross-rank comparison reads it (steps as objects)."""
    return RankReport(**{**d, "steps": [StepBreakdown(**s) for s in d["steps"]]})


def _comm_us(d: dict) -> float:
    return float(sum(s["communication_us"] for s in d["steps"]))


def build_job_report(files: Sequence[str], engine: SerialEngine | RayEngine, entry: str | None = None,
                     top: int = 15, use_cache: bool = True, progress: Progress | None = None,
                     timings: dict[str, float] | None = None, reuse: bool = False, keep: bool = False,
                     detail: int | None = pipeline.DETAIL_RANKS) -> dict:
    """The report (schema aiprof.report/2) of the ranks in ``files``, analysed on ``engine``.
    ``timings``: filled with the driver's own steps' wall seconds (match, compare, assemble).
    ``reuse``: read each task's result kept by an earlier run where its inputs and the code are
    unchanged (scale.results); ``keep``: keep the results computed (`aiprof analyze` keeps them
    always and reads them unless --no-cache). ``detail``: see :func:`pipeline.assemble`."""
    clock = timings if timings is not None else {}
    reuse = reuse and use_cache
    # 1. ingest (a rank's summary, and each later result, is kept beside its store: reused while
    # its inputs and the code are unchanged; see scale.results)
    ing: list[tasks.Ingested] = [None] * len(files)  # type: ignore[list-item]
    placed: dict[int, str] = {}
    fingerprints: dict[str, dict] = {}  # each trace's, taken once for every phase's keys
    for i, out in run_phase(engine, "ingest", tasks.ingest_rank,
                            [Call((f, k, use_cache), k, [f]) for k, f in enumerate(files)], reuse, keep, progress,
                            placed=placed, seen=fingerprints):
        ing[i] = out
    nodes = [placed.get(i, "") for i in range(len(files))]
    seen: dict[int, tasks.Ingested] = {}
    for x in ing:
        if x.rank in seen:
            raise TraceError(x.source, f"rank {x.rank} appears twice (also in {seen[x.rank].source})")
        seen[x.rank] = x
    order = sorted(range(len(ing)), key=[x.rank for x in ing].__getitem__)
    ing = [ing[k] for k in order]
    nodes = [nodes[k] for k in order]
    ranks = [x.rank for x in ing]
    world = max([x.world_size for x in ing] + [len(ing)])
    multi = len(ing) >= 2
    # 2. match collectives across ranks; each rank's coupling
    with _step(clock, "match_s"):
        colls = [x.collectives for x in ing]
        columns: dict = {}
        matched = align_and_arrivals(colls, columns) if multi else None
        columns["collectives"] = {c.rank: c for c in colls}
        rcols = coupling(columns, {x.rank: x.comm_end for x in ing}) if multi else {}
        off = columns.get("offset_ns") or {}
        # every coupled rank's unprofiled step, for the pairs' calibration and pricing (issue 28, item 7)
        job_un = unprofiled_target_ns([x.unprofiled_ns for x in ing if x.rank in rcols]) if rcols else None
        inputs = {x.rank: tasks.RankInput(x.source, x.index, rcols.get(x.rank), float(off.get(x.rank, 0.0)),
                                          job_unprofiled_ns=job_un) for x in ing}
        coupled = bool(rcols)
        if coupled:  # the rank that prices the job's causes reads its collectives' sizes through it
            inputs[ranks[0]].rank_index = (columns.get("rank_index") or {}).get(ranks[0])
        pick = partners(ranks, matched[1].waited_us if matched else {}, rcols,
                        matched[1].caused_wait_us if matched else {})
    token = uuid.uuid4().hex
    asked = experimental_asked()  # read here: the workers do not share this process's environment
    # 3. analyse each rank; a report that keeps the tables of a few ranks only (pipeline.assemble)
    # gets them in step 7, once the diagnosis has named those ranks
    tables = detail is None or len(ranks) <= detail
    res: list[tasks.Analysed] = [None] * len(ing)  # type: ignore[list-item]
    calls = []
    for r in ranks:
        partner = inputs.get(pick.get(r))
        calls.append(_call((inputs[r], partner, entry, top, token, coupled and r == ranks[0], len(ranks), coupled,
                            asked, tables), token, asked, _sources(inputs[r], partner)))
    for i, out in run_phase(engine, "analyse", tasks.analyse_rank, calls, reuse, keep, progress, nodes,
                            seen=fingerprints):
        res[i] = out
    reports = [r.report for r in res]
    # 4. compare the ranks
    with _step(clock, "compare_s"):
        cross = None
        if multi:
            cr = cross_rank_of(ranks, {x.rank: x.host for x in ing}, world, colls, [_rank_view(d) for d in reports],
                               None, None, matched)
            cross = as_dict(cr)
        del colls, columns, ing, matched
    # 5. stragglers: evidence and cause from the straggler's and its base rank's traces
    straggler_c, straggler_s = [], []
    if cross and cross["stragglers"]:
        by_rank = {r.rank: r for r in res}
        evs = cross["stragglers"]
        calls = []
        for ev in evs:
            slow, partner, base = (inputs[ev["straggler_rank"]], inputs.get(pick.get(ev["straggler_rank"])),
                                   inputs[ev["base_rank"]])
            waiting = {w: by_rank[w].report["steps"] for w in ev.get("waiting_ranks", []) if w in by_rank}
            calls.append(_call((ev, slow, partner, base, entry, top, token, waiting,
                                by_rank[ev["straggler_rank"]].causes, asked), token, asked, _sources(slow, partner, base)))
        where = [nodes[ranks.index(ev["straggler_rank"])] for ev in evs]
        for i, f in run_phase(engine, "stragglers", tasks.straggler_rank, calls, reuse, keep, progress, where,
                              seen=fingerprints):
            evs[i]["differs"] = f.differs
            by_rank[evs[i]["straggler_rank"]].causes = f.own  # one of them may now name the straggler
            straggler_c.append((i, f.causes))
            straggler_s.append((i, f.symptoms))
    # in the in-process diagnosis's order: ranks' causes, the job's, the stragglers'
    with _step(clock, "assemble_s"):
        causes = [c for r in res for c in r.causes]
        symptoms = [s for r in res for s in r.symptoms]
        comm_us = {r.rank: _comm_us(r.report) for r in res}
        for c in res[0].job_causes if coupled else []:
            if not all(r.conditions.get(c.code, True) for r in res):
                continue  # some rank does not meet the cause's condition (no collective to skip): not the job's
            c.claims = pipeline.job_claims(c, comm_us)  # as in process: on every rank, not on the pair only
            causes.append(c)
        causes += [c for _, cs in sorted(straggler_c, key=lambda t: t[0]) for c in cs]
        symptoms += [s for _, ss in sorted(straggler_s, key=lambda t: t[0]) for s in ss]
        # 6. assemble
        diagnosis = assemble(causes, symptoms, [r.baseline for r in res])
    # 7. the tables of the ranks the report keeps whole (the others' sections are brief)
    if not tables:
        whole = pipeline.detail_ranks(ranks, cross, diagnosis, detail)
        at = {r: i for i, r in enumerate(ranks)}
        calls = [_call((inputs[r], entry, top), token, asked, _sources(inputs[r])) for r in whole]
        for i, section in run_phase(engine, "tables", tasks.rank_tables, calls, reuse, keep, progress,
                                    [nodes[at[r]] for r in whole], seen=fingerprints):
            reports[at[whole[i]]] = section
    with _step(clock, "assemble_s"):
        report = pipeline.assemble(world, reports, [inputs[r].source for r in ranks], cross, diagnosis, detail)
    return report


def capture_report(cap: Capture, entry: str | None = None, top: int = 15,
                   detail: int | None = pipeline.DETAIL_RANKS) -> dict:
    """The report of an opened capture, in this process, as `aiprof analyze` makes it: up to
    JOINT_MAX_RANKS ranks the joint replay (:func:`pipeline.build_report`), above it the per-rank
    path Ray runs (each rank priced with its partner, :func:`build_job_report`), here on a
    :class:`SerialEngine`. pipeline.build_report does not couple more ranks than that: on a
    64-rank job it priced them one by one, and the straggler that costs 48.9 % of the step (the
    Ray path's first cause) went unpriced, the report saying "Nothing to fix". The capture's
    ranks are in their stores already (opening it ingested them): the tasks read those."""
    if len(cap.ranks) <= JOINT_MAX_RANKS:
        return pipeline.build_report(cap, entry, top, detail)
    with SerialEngine() as eng:
        return build_job_report([r.source for r in cap.ranks], eng, entry, top, use_cache=True, detail=detail)


def _call(args: tuple, token: str, asked: frozenset[str], sources: list[str]) -> Call:
    """A task's call. What names its result is its arguments less the run's ``token``, with the
    experimental codes ``asked`` sorted (a set's order differs between processes)."""
    return Call(args, tuple(sorted(a) if a is asked else a for a in args if a is not token), sources)


def _sources(*inputs: tasks.RankInput | None) -> list[str]:
    """The traces a task reads: its rank's first (where its result is kept), then the others'."""
    return [x.source for x in inputs if x is not None]


def partners(ranks: list[int], waited_us: dict, coupled: dict, caused_us: dict | None = None) -> dict[int, int]:
    """Each coupled rank's partner in pricing. The job's step is its slowest rank's, so the pair
    must hold the rank that holds the job back: every rank is paired with the one that made the
    others wait longest at collectives (``caused_us``), and that rank with the job's most
    typical rank (the one whose time waiting at collectives is closest to the median rank's: not
    a straggler, not the earliest), which stands for the others once it is fixed. Without a rank
    that made others wait, every rank is paired with the most typical one (that one with the
    next most typical). Empty when fewer than two ranks are coupled."""
    cand = [r for r in ranks if r in coupled]
    if len(cand) < 2:
        return {}
    med = float(np.median([waited_us.get(r, 0.0) for r in cand]))
    typical = sorted(cand, key=lambda r: (abs(waited_us.get(r, 0.0) - med), r))
    caused = caused_us or {}
    slow = max(cand, key=lambda r: (caused.get(r, 0.0), -r))
    if caused.get(slow, 0.0) <= 0:
        ref, ref2 = typical[:2]
        return {r: ref if r != ref else ref2 for r in cand}
    ref = next(r for r in typical if r != slow)
    return {r: slow if r != slow else ref for r in cand}

