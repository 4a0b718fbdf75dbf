"""The stages of the report (aiprof.pipeline's docstring says which, and who calls them)."""
from __future__ import annotations

from dataclasses import dataclass

from aiprof import __version__
from aiprof.analysis.ranks import cross_rank
from aiprof.analysis.report import SCHEMA, RankReport, brief, rank_section
from aiprof.diagnosis import causes as registry
from aiprof.diagnosis import engine
from aiprof.diagnosis.detector import JobFacts
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import RankCollectives
from aiprof.diagnosis.job import attach_collectives
from aiprof.diagnosis.model import EXPOSED_COMM, Cause, Claim, Symptom
from aiprof.records import as_dict
from aiprof.trace.store import Capture, RankTrace


def analyse_rank(rt: RankTrace, entry: str | None = None, top: int = 15, coupling: RankCollectives | None = None,
                 offset_ns: float = 0.0, settled: bool = False, tables: bool = True) -> tuple[RankReport, RankFacts]:
    """One rank's report section and its diagnosis facts. With ``coupling``
    (diagnosis.job.coupling) the rank's replay waits at each collective for the other ranks'
    recorded arrivals; ``offset_ns`` puts the rank on the reference clock. ``settled``: the caller
    settles the rank with a partner (engine.rank_facts: no calibration or baseline of its own).
    ``tables`` False: the section without its tables (analysis.report.rank_section)."""
    rep, a = rank_section(rt, entry, top, tables)
    facts = engine.rank_facts(rt, a.steps, a.breakdown, a.tree, a.gaps, a.runtime, a.kernels, a.comm, a.has_gpu,
                              a.host_idle_by_class, colls=coupling, offset_ns=offset_ns, settled=settled)
    facts.extra["serving"] = a.serving  # the serving causes read the iterations' phases and batches
    facts.counters = a.counters
    return rep, facts


@dataclass
class RankSummary:
    """What the rank stage leaves for the job stage: small, whatever the trace's size."""

    rank: int
    causes: list[Cause]  # priced, in registry order
    symptoms: list[Symptom]
    baseline: dict  # the report's "baseline" row
    conditions: dict[str, bool]  # per JOB detector with a condition on every rank: whether this rank meets it


def rank_stage(f: RankFacts, pricer: engine.Pricer, coupled: bool,
               asked: frozenset[str] | None = None) -> RankSummary:
    """One rank's causes (RANK detectors, and UNCOUPLED ones when ``coupled`` is False: no matched
    collectives couple the job), each priced by ``pricer``; its symptoms, baseline row and job
    conditions. ``asked``: the experimental codes to run (default: $AIPROF_EXPERIMENTAL_CAUSES)."""
    causes, symptoms = engine.diagnose_rank(f, pricer, coupled, asked)
    # the conditions matter only to a coupled job's causes
    return RankSummary(f.rank, causes, symptoms, engine.baseline_entry(f, coupled, pricer),
                       engine.rank_conditions(f, asked) if coupled else {})


def job_stage(job: JobFacts, summaries: list[RankSummary] | None = None,
              asked: frozenset[str] | None = None) -> list[Cause]:
    """The job's causes (the registry's JOB detectors) of a job whose ranks collectives couple;
    ``summaries``: every rank's, for the conditions a job cause needs on every rank (default:
    those of the ranks in ``job``)."""
    return engine.diagnose_job(job, [s.conditions for s in summaries] if summaries is not None else None, asked)


def cross_rank_stage(job: JobFacts, asked: frozenset[str] | None = None) -> tuple[list[Cause], list[Symptom]]:
    """The causes and symptoms found once the ranks are compared (``job.cross``: the stragglers)."""
    return engine.diagnose_cross(job, asked)


def job_claims(c: Cause, comm_us: dict[int, float]) -> list[Claim]:
    """A job cause's claims on every rank of the job: the symptoms it claims on the ranks in hand,
    on all of them (a JOB detector claims each rank's exposed communication, ``comm_us``, and
    the rest at 0 µs), for a job whose causes were found on some of its ranks only."""
    codes = list(dict.fromkeys(cl.symptom for cl in c.claims))
    return [Claim(code, r, comm_us[r] if code == EXPOSED_COMM else 0.0) for code in codes for r in comm_us]


def diagnose(facts: list[RankFacts], cross: dict | None = None, columns: dict | None = None,
             asked: frozenset[str] | None = None) -> dict:
    """Every rank's causes and symptoms, the job's and the cross-rank ones, priced, linked and
    ranked (the report's ``causes``, ``symptoms``, ``baseline``). With several ranks whose
    collectives match, they couple the pricing (the joint replay)."""
    asked = registry.experimental_asked() if asked is None else asked
    coupled = len(facts) >= 2 and columns is not None and attach_collectives(facts, columns)
    pricer = engine.Pricer(facts, coupled)
    summaries = [rank_stage(f, pricer, coupled, asked) for f in facts]
    causes = [c for s in summaries for c in s.causes]
    symptoms = [x for s in summaries for x in s.symptoms]
    if coupled:
        causes += job_stage(JobFacts(facts, pricer, columns or {}, len(facts)), summaries, asked)
    if cross:
        cs, ss = cross_rank_stage(JobFacts(facts, pricer, columns or {}, len(facts), cross, causes), asked)
        causes += cs
        symptoms += ss
    return engine.assemble(causes, symptoms, [s.baseline for s in summaries])


#: Up to this many ranks the report keeps every rank's tables; above it, those of the ranks its
#: diagnosis names, at most this many (detail_ranks). It is as many ranks as the in-process joint
#: replay analyses (diagnosis.job.JOINT_MAX_RANKS), so a report of the in-process size is whole.
#: Past it, every rank's tables made the report ~50 kB a rank of ~30 MB (79-83 MB at 1,024 ranks),
#: three quarters of it tables of ranks nothing points at. The UI computes a brief rank's tables
#: when they are asked for (server/data.py).
DETAIL_RANKS = 16


def detail_ranks(ranks: list[int], cross: dict | None, diagnosis: dict, most: int = DETAIL_RANKS) -> list[int]:
    """The ranks whose tables a report of more than ``most`` ranks keeps, at most ``most``, the
    most telling first: each straggler and the rank it is compared with, then the ranks of the
    causes in their ranked order (the reported ones: not ``minor``, which names most ranks of a
    large job), then the ranks found abnormal, then the lowest rank (where the job's causes are
    priced)."""
    cross = cross or {}
    named = [r for ev in cross.get("stragglers") or () for r in (ev.get("straggler_rank"), ev.get("base_rank"))]
    named += [c.get("rank") for c in diagnosis.get("causes") or ()]
    named += [int(k) for k, v in sorted((cross.get("flags") or {}).items(), key=lambda kv: int(kv[0]))
              if "abnormal" in v]
    have = set(ranks)
    out = list(dict.fromkeys(r for r in [*named, min(ranks, default=None)] if r in have))
    return out[:most]


def assemble(world_size: int, ranks: list[dict], sources: list[str], cross: dict | None, diagnosis: dict,
             detail: int | None = DETAIL_RANKS) -> dict:
    """The report (schema aiprof.report/2) from its parts: the ranks' sections (report dicts, in
    rank order), the cross-rank comparison and the diagnosis. Above ``detail`` ranks, the
    sections of the ranks that detail_ranks does not pick are brief (analysis.report.brief), and
    ``capture.detail_ranks`` lists those that are not (absent: every rank keeps its tables, as
    with ``detail`` None)."""
    capture = {"world_size": world_size, "ranks_found": [r["rank"] for r in ranks], "sources": sources}
    if detail is not None and len(ranks) > detail:
        keep = detail_ranks(capture["ranks_found"], cross, diagnosis, detail)
        capture["detail_ranks"] = keep
        ranks = [r if r["rank"] in keep else brief(r) for r in ranks]
    return {
        "schema": SCHEMA,
        "generator": {"name": "aiprof", "version": __version__},
        "capture": capture,
        "ranks": ranks,
        "cross_rank": cross,
        # causes (ranked by saving) explain symptoms; docs/findings.md
        **diagnosis,
    }


def build_report(cap: Capture, entry: str | None = None, top: int = 15, detail: int | None = DETAIL_RANKS) -> dict:
    """The full report of a capture as a JSON-ready dict, every stage in this process, the ranks
    priced together by the joint replay up to JOINT_MAX_RANKS ranks (above it, uncoupled: a
    straggler goes unpriced; scale.job_report.capture_report makes the Ray path's report there).
    ``detail``: see :func:`assemble` (None: every rank's tables, whatever the ranks)."""
    pairs = [analyse_rank(rt, entry, top) for rt in cap.ranks]
    ranks = [p[0] for p in pairs]
    facts = [p[1] for p in pairs]
    columns: dict = {}
    cr = cross_rank(cap, ranks, columns=columns) if len(ranks) >= 2 else None
    cross = as_dict(cr) if cr is not None else None
    return assemble(cap.world_size, [as_dict(r) for r in ranks], [r.source for r in cap.ranks], cross,
                    diagnose(facts, cross, columns), detail)
