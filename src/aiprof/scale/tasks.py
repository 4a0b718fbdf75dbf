"""The per-rank work of a scaled-out analysis and the small summaries it returns.

Each function runs where the engine puts it (a Ray worker, or this process) and reads the rank's
trace itself: the driver sends a path and receives a summary of a few hundred kB at most. The
store a rank's ingest writes (beside the trace, or in the cache folder) is what the later tasks
of that rank read, so a trace is parsed once.

Pricing here is per rank and pair: each cause is priced by the joint replay of its rank and its
partner, the rank that holds the job back (for that rank, a typical one; the joint replay of
every rank needs every rank's graph in one process; see docs/scale.md and job_report.partners).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof import pipeline
from aiprof.analysis.breakdown import StepBreakdown
from aiprof.analysis.ranks import RankCollectives as Collectives
from aiprof.analysis.ranks import diff_evidence, rank_collectives, rank_host
from aiprof.analysis.report import rank_section
from aiprof.diagnosis.detector import JobFacts
from aiprof.diagnosis.engine import Pricer, unprofiled_step_ms
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import RankCollectives as Coupling
from aiprof.diagnosis.job import comm_ends, settle
from aiprof.diagnosis.model import Cause, Symptom
from aiprof.records import as_dict
from aiprof.trace.store import RankTrace, ingest


@dataclass
class Ingested:
    """A rank after its ingest: who it is and its collectives (for the cross-rank matching)."""

    rank: int
    index: int  # the file's position in the capture (ranks without a number are numbered by it)
    source: str
    host: str
    world_size: int
    collectives: Collectives
    comm_end: np.ndarray  # when each collective's communication ended (diagnosis.job.comm_ends)
    unprofiled_ns: float | None = None  # the step its agent measured before the capture (meta.json)


@dataclass
class RankInput:
    """What a task needs to re-open and couple one rank (see :func:`open_rank`)."""

    source: str
    index: int
    coupling: Coupling | None = None  # diagnosis.job.coupling of this rank; None: not coupled
    offset_ns: float = 0.0  # the rank's clock offset (ns to add to put it on the reference clock)
    # the rank's column of the cross-rank matching (analysis.ranks.align_and_arrivals
    # "rank_index"): sent for the rank that prices the job's causes, which read message sizes
    rank_index: np.ndarray | None = None
    # the job's unprofiled step (diagnosis.job.unprofiled_target_ns of every coupled rank's): what
    # the rank and its partner are fitted to, as every rank is in process
    job_unprofiled_ns: float | None = None


@dataclass
class Analysed:
    """A rank's report section and its priced causes and symptoms."""

    rank: int
    report: dict  # the report's "ranks" entry (as_dict of analysis.report.RankReport)
    causes: list[Cause]  # priced, in detector order; edits dropped
    symptoms: list[Symptom]
    baseline: dict  # the report's "baseline" row
    conditions: dict[str, bool]  # pipeline.RankSummary.conditions: this rank's, for the job's causes
    job_causes: list[Cause]  # the job's causes (the registry's JOB detectors) priced here, when asked for


@dataclass
class StragglerFound:
    """A straggler's diff evidence and its cause, or its own cause promoted."""

    differs: dict
    causes: list[Cause]
    symptoms: list[Symptom]
    own: list[Cause]  # the straggler's own causes, one possibly promoted to the straggler's cause


@dataclass
class _Waiting:
    """A waiting rank as straggler.causes reads it: its number and its steps' breakdown."""

    rank: int
    breakdown: list[StepBreakdown]


def open_rank(inp: RankInput, use_cache: bool = True) -> RankTrace:
    """The rank's trace: its store when cached (ingest re-parses only when it is not)."""
    return ingest(inp.source, inp.index, None, use_cache)


def _strip(causes: list[Cause]) -> list[Cause]:
    """Drop what only pricing needs (the edit's arrays, the claimed host nodes) before shipping."""
    for c in causes:
        c.edit = None
        c.region = None
    return causes


def ingest_rank(source: str, index: int, use_cache: bool = True) -> Ingested:
    """Ingest one trace file into its store (or find it cached) and summarise its collectives."""
    rt = ingest(source, index, None, use_cache)
    rc = rank_collectives(rt)
    un = unprofiled_step_ms(rt)
    return Ingested(rank=rt.rank, index=index, source=source, host=rank_host(rt), world_size=rt.world_size,
                    collectives=rc, comm_end=np.asarray(comm_ends(rt, rc)), unprofiled_ns=un * 1e6 if un else None)


# The partner ranks' facts, per worker process, keyed by the analysis's token and the rank, most
# recently used last. One analysis has two partners (job_report.partners: the slow rank for every
# other rank, a typical rank for the slow one) and a worker's tasks switch between them, so one
# entry would rebuild a partner at each switch. Entries of an earlier analysis are dropped first:
# a worker holds at most PARTNER_CACHE_SIZE ranks' facts.
PARTNER_CACHE_SIZE = 2
_PARTNER: dict = {}


def _partner_facts(inp: RankInput, entry: str | None, top: int, token: str) -> RankFacts:
    """The partner rank's facts, as analysed (calibration undone from any earlier pairing)."""
    key = (token, inp.source, inp.index, entry, top)
    hit = _PARTNER.pop(key, None)
    if hit is None:
        for old in [k for k in _PARTNER if k[0] != token]:
            del _PARTNER[old]
        while len(_PARTNER) >= PARTNER_CACHE_SIZE:  # evicted before the build: the bound holds throughout
            del _PARTNER[next(iter(_PARTNER))]
        # settled: _pair settles it with the rank it partners (its own fit and baseline unused)
        _, f = pipeline.analyse_rank(open_rank(inp), entry, top, inp.coupling, inp.offset_ns, settled=True,
                                     tables=False)  # its report section is not kept
        hit = (f, f.graph.alpha, f.graph.beta, f.base, f.host_scale)
    _PARTNER[key] = hit
    f, alpha, beta, base, scale = hit
    f.graph.deflate(alpha, beta)
    f.base, f.host_scale = base, scale
    return f


def _pair(rt: RankTrace, inp: RankInput, partner: RankInput | None, entry: str | None, top: int,
          token: str, tables: bool = True) -> tuple[object, RankFacts, list[RankFacts], Pricer]:
    """The rank's report and facts, and the pricer: the joint replay of the rank with its
    partner when both are coupled (calibrated together), else the rank's own replay.
    ``tables``: the report section with its tables (analysis.report.rank_section)."""
    paired = partner is not None and inp.coupling is not None and partner.coupling is not None
    # a paired rank is settled below (job.settle fits the deflation and replays the baseline anew,
    # whatever rank_facts left): rank_facts skips its own
    rep, f = pipeline.analyse_rank(rt, entry, top, inp.coupling, inp.offset_ns, settled=paired, tables=tables)
    if not paired:
        return rep, f, [f], Pricer([f], False)
    pair = [f, _partner_facts(partner, entry, top, token)]
    # the job's measured step, not the pair's alone; a rank whose steps were split from the
    # agent's iterations has its own scale for it (engine.rank_facts): the pair's then
    target = None if any(q.steps.within for q in pair) else inp.job_unprofiled_ns
    settle(pair, target)
    return rep, f, pair, Pricer(pair, True, target, {q.rank: q.base for q in pair})


def analyse_rank(inp: RankInput, partner: RankInput | None, entry: str | None, top: int, token: str,
                 job_cause: bool, n_ranks: int = 0, coupled: bool = False,
                 asked: frozenset[str] = frozenset(), tables: bool = True) -> Analysed:
    """One rank's report, causes and symptoms (pipeline.analyse_rank, pipeline.rank_stage). Each
    cause is priced by the joint replay of this rank and its ``partner`` (job_report.partners:
    the rank holding the job back, standing for all the others: the job's step is the slower of
    the two), or on this rank alone when the job is not coupled. ``coupled``: collectives couple
    the job's ranks (else the UNCOUPLED detectors run, as in process).
    ``job_cause``: also run the job's detectors (pipeline.job_stage) on the pair, as among the
    job's ``n_ranks`` ranks, priced on both ranks (the driver asks the lowest rank, as the
    in-process diagnosis does). ``token`` names the analysis; ``asked``: the experimental codes.
    ``tables`` False: the report section without its tables (a report of many ranks keeps those
    of a few ranks, computed afterwards by :func:`rank_tables`)."""
    rt = open_rank(inp)
    rep, f, pair, pricer = _pair(rt, inp, partner, entry, top, token, tables)
    s = pipeline.rank_stage(f, pricer, coupled, asked)
    job = []
    if job_cause and pricer.coupled:
        # the first rank's collectives and matching column: what the job detectors read of it
        columns = ({"collectives": {f.rank: rank_collectives(rt)}, "rank_index": {f.rank: inp.rank_index}}
                   if inp.rank_index is not None else {})
        job = pipeline.job_stage(JobFacts(pair, pricer, columns, n_ranks or len(pair)), asked=asked)
    return Analysed(rank=rt.rank, report=as_dict(rep), causes=_strip(s.causes), symptoms=s.symptoms,
                    baseline=s.baseline, conditions=s.conditions, job_causes=_strip(job))


def straggler_rank(ev: dict, slow: RankInput, partner: RankInput | None, base: RankInput, entry: str | None,
                   top: int, token: str, waiting: dict[int, list[dict]], own: list[Cause],
                   asked: frozenset[str] = frozenset()) -> StragglerFound:
    """A straggler's evidence (what its median step does more than the base rank's) and its
    cause, priced like its other causes (with its partner). ``ev`` is the cross-rank straggler
    entry, ``waiting`` the waiting ranks' step breakdowns (report dicts), ``own`` the causes
    the straggler's analysis found (one may become the straggler's cause)."""
    slow_rt = open_rank(slow)
    ev = dict(ev, differs=diff_evidence(open_rank(base), slow_rt))
    _, _, pair, pricer = _pair(slow_rt, slow, partner, entry, top, token, tables=False)  # the section is not kept
    have = {x.rank for x in pair}
    others = [_Waiting(r, [StepBreakdown(**s) for s in steps]) for r, steps in waiting.items() if r not in have]
    cs, ss = pipeline.cross_rank_stage(JobFacts([*pair, *others], pricer, {}, 0, {"stragglers": [ev]}, own), asked)
    return StragglerFound(differs=ev["differs"], causes=_strip(cs), symptoms=ss, own=own)


def rank_tables(inp: RankInput, entry: str | None, top: int) -> dict:
    """A rank's report section with its tables (the report's ``ranks`` entry): for the ranks a
    report of many ranks keeps whole, once its diagnosis has named them (pipeline.detail_ranks)."""
    return as_dict(rank_section(open_rank(inp), entry, top)[0])
