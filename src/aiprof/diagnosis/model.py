"""The causal model: causes (mechanism, place, remedy, priced saving) explain symptoms.

A *symptom* is what a user sees in the numbers: GPU idle, exposed communication, a slow step, a
rank waiting for another. A *cause* is the mechanism behind it, at a place in the user's code,
with the one change that removes it and what that change saves (from the what-if replay). Each
cause claims the part of each symptom it explains; what no cause claims stays an orphan symptom.
Schema of both in docs/report.md, definitions in docs/findings.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof.diagnosis.replay import Edit

HIGH, MEDIUM, LOW = "high", "medium", "low"
# Severity from the saving's share of the (unprofiled) step time.
HIGH_SHARE = 0.10  # a tenth of every step: the first thing to fix
MEDIUM_SHARE = 0.03  # worth a change; below it the gain hides in run-to-run noise
# Causes that save less than this share of a step are not listed among the causes (the report
# keeps them under ``minor``): they would bury the ones that matter, and a healthy job must come
# out quiet.
MIN_REPORTED_SHARE = 0.01
# A job none of whose causes reaches MEDIUM_SHARE is healthy: the report says so in one line
# (what a fix below it would save hides in run-to-run noise).
HEALTHY_MAX_SHARE = MEDIUM_SHARE

# symptom codes
GPU_IDLE = "GPU_IDLE"
EXPOSED_COMM = "EXPOSED_COMM"
EXPOSED_COPY = "EXPOSED_COPY"
SLOW_STEP = "SLOW_STEP"
WAITING_RANK = "WAITING_RANK"
SLOW_KERNELS = "SLOW_KERNELS"


@dataclass
class Place:
    """Where the cause lives: the user's Python site, the op or kernel, the rank, the steps."""

    kind: str  # python | op | kernel | optimizer | dataloader | rank | collective | step
    name: str
    site: str = ""  # nearest user frame, e.g. "train.py(42): step"
    stack: list[str] = field(default_factory=list)  # Python frames, outermost first
    steps: list[int] = field(default_factory=list)  # step numbers where it occurs ([] = every step)


@dataclass
class Claim:
    """The part of one symptom a cause explains (µs over the analysed steps, as recorded)."""

    symptom: str  # symptom code
    rank: int | None
    us: float


@dataclass
class Cause:
    """One mechanism found in the capture, before and after pricing."""

    code: str
    rank: int | None  # None: job-wide
    title: str  # one line; numbers in it are the ones the saving reports
    mechanism: str  # why it costs time
    remedy: str  # the one change that fixes it
    place: Place
    evidence: dict
    edit: Edit | None = None  # the fix, as a change to the replayed graph
    claims: list[Claim] = field(default_factory=list)
    region: np.ndarray | None = None  # host-tree nodes it owns (kept from the generic detectors)
    # filled by the engine
    saving: dict = field(default_factory=dict)
    severity: str = LOW
    id: str = ""


@dataclass
class Symptom:
    """One observed problem of one rank (or of the job), and how much of it the causes explain."""

    code: str
    rank: int | None
    title: str
    us: float  # amount over the analysed steps, as recorded
    per_step_us: float
    share: float  # of the recorded step time
    detail: dict = field(default_factory=dict)
    explained_by: list[dict] = field(default_factory=list)  # [{"cause": id, "us": float}]
    unexplained_us: float = 0.0
    id: str = ""


def severity_of(share: float) -> str:
    """Severity of a cause from its saving's share of the step."""
    return HIGH if share >= HIGH_SHARE else MEDIUM if share >= MEDIUM_SHARE else LOW
