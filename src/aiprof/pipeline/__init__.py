"""The report pipeline: the stages every report goes through, wherever they run.

1. :func:`analyse_rank` — one rank's trace → its report section and its diagnosis facts;
2. :func:`rank_stage` — the rank's causes (the registry's RANK, and UNCOUPLED, detectors),
   priced, its symptoms, its baseline row and its conditions for the job's causes: a small
   :class:`RankSummary`;
3. the job stage — the cross-rank comparison, the registry's JOB detectors (:func:`job_stage`)
   and CROSS_RANK ones (:func:`cross_rank_stage`);
4. :func:`assemble` — causes ranked and linked to symptoms, the report dict.

:func:`build_report` runs them in this process on a whole capture; ``aiprof.scale`` runs the
per-rank ones as tasks on an engine (Ray, or this process) and ships their summaries back. Both
call these same functions, so a report cannot depend on where it was computed
(tests/scale/test_drift.py; docs/architecture.md).
"""
from aiprof.pipeline.stages import (
    DETAIL_RANKS,
    RankSummary,
    analyse_rank,
    assemble,
    build_report,
    cross_rank_stage,
    detail_ranks,
    diagnose,
    job_claims,
    job_stage,
    rank_stage,
)

__all__ = ["DETAIL_RANKS", "RankSummary", "analyse_rank", "assemble", "build_report", "cross_rank_stage",
           "detail_ranks", "diagnose", "job_claims", "job_stage", "rank_stage"]
