"""The one protocol every cause detector follows, and the facts a job-level detector reads.

A detector is declared once, in its cause's module, as ``DETECTOR = Detector(...)``: its code,
its scope (which facts it is given and when it runs), what it reads, and ``detect(facts) ->
list[Cause]``. ``diagnosis/causes/__init__.py`` holds the one ordered registry of them; the
engine iterates it and wires nothing by hand (docs/architecture.md, "Add a cause").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Symptom

if TYPE_CHECKING:  # the engine imports the registry, which imports this module
    from aiprof.diagnosis.engine import Pricer


class Scope(str, Enum):
    """When a detector runs and which facts it is given."""

    #: every rank, given its :class:`RankFacts`; the engine prices each cause on the rank's pricer
    RANK = "rank"
    #: a rank of a job whose ranks no matched collectives couple (one rank analysed alone, or
    #: ranks without common collectives): given its :class:`RankFacts`, priced like RANK
    UNCOUPLED = "uncoupled rank"
    #: a job whose ranks collectives couple: given :class:`JobFacts`; the detector prices its
    #: cause itself, as a change every rank makes
    JOB = "job"
    #: after the ranks are compared: given :class:`JobFacts` with the comparison and the causes
    #: found so far (the straggler's cause explains the others' waits)
    CROSS_RANK = "cross-rank"


@dataclass(frozen=True)
class Detector:
    """One cause detector (the cause's module docstring says its mechanism and evidence)."""

    code: str
    scope: Scope
    #: the facts it reads: RankFacts fields (RANK, UNCOUPLED) or JobFacts fields (JOB, CROSS_RANK)
    reads: tuple[str, ...]
    #: the facts of its scope -> its causes (RANK/UNCOUPLED: unpriced; JOB/CROSS_RANK: priced)
    detect: Callable[[Any], list[Cause]]
    #: its remedy would also hide the specific causes' symptoms: priced once those are fixed
    generic: bool = False
    #: RANK: the classes of work its fix acts on (analysis.hotspots / analysis.ranks classes): on a
    #: straggler that does more of one of them than the median rank, it can be the straggler's cause
    acts_on: tuple[str, ...] = ()
    #: it reads what every other detector of its scope found (``facts.extra["found"]``): runs last
    last: bool = False
    #: it failed its own validation pair: runs only when named in $AIPROF_EXPERIMENTAL_CAUSES
    experimental: bool = False
    #: JOB scope: a condition every rank of the job must meet for the cause to be the job's; the
    #: rank stage evaluates it where the rank is analysed, so a job analysed rank by rank can check it
    every_rank: Callable[[RankFacts], bool] | None = None
    #: the symptoms its scope's facts show and its causes claim (a straggler's waiting ranks)
    symptoms: Callable[[Any], list[Symptom]] | None = None


@dataclass
class JobFacts:
    """What a JOB or CROSS_RANK detector reads."""

    #: the ranks in hand: every rank in process; on an engine, the rank that prices the job's
    #: causes and its partner (scale/job_report.partners), plus the waiting ranks' step breakdowns
    facts: list[RankFacts]
    pricer: Pricer
    #: the cross-rank matching (analysis.ranks.align_and_arrivals): collectives, rank_index, offset_ns
    columns: dict = field(default_factory=dict)
    #: the job's ranks (more than len(facts) when the job is analysed rank by rank)
    n_ranks: int = 0
    #: CROSS_RANK: the cross-rank comparison (analysis.ranks.CrossRank as a dict)
    cross: dict | None = None
    #: CROSS_RANK: the causes found so far (one of the straggler's own may become its cause)
    found: list[Cause] = field(default_factory=list)
