"""The report (schema aiprof.report/2, docs/report.md) as typed objects.

``Report.from_dict(build_report(cap))`` types the JSON-ready dict that every renderer reads;
``to_dict()`` gives it back, key for key, so the JSON report is ``to_dict()`` of these objects
(tests/api checks it against ``aiprof analyze --json``). Keys this version does not type (the
schema may add fields within a version) are kept in ``extra`` and written back by ``to_dict()``.
Fields that hold one analysis each (``RankReport.kernels``, ``runtime``, ...) stay dicts: their
contents are documented per field in docs/report.md.
"""
from __future__ import annotations

import copy
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional, TypeVar

from aiprof.analysis.report import DETAIL_FIELDS, is_brief
from aiprof.api import render
from aiprof.report import json_report

R = TypeVar("R", bound="Record")


def _convert(hint: Any, value: Any) -> Any:
    """``value`` (from the dict) as the field's type: records and lists / optionals of records."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value]
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)  # the caller may change what it gets: our copy stays as read


class Record:
    """A dataclass read from, and written back to, one object of the JSON report."""

    extra: dict

    @classmethod
    def from_dict(cls: type[R], d: dict) -> R:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in fields(cls) if f.name != "extra"]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"{cls.__name__}: the report has no {', '.join(missing)} (schema {d.get('schema', '?')})")
        kw = {n: _convert(hints[n], d[n]) for n in names}
        return cls(**kw, extra={k: copy.deepcopy(v) for k, v in d.items() if k not in names})

    def to_dict(self) -> dict:
        """This object as the JSON report writes it (a new dict: changing it changes nothing here)."""
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}
        out.update(copy.deepcopy(self.extra))
        return out


@dataclass
class Place(Record):
    """Where a cause acts: ``kind`` python|op|kernel|optimizer|dataloader|rank|collective|step."""

    kind: str
    name: str
    site: str  # the user's source line, "file.py(42): function" ("" when unknown)
    stack: list[str]  # outermost frame first
    steps: list[int]  # the steps it acts in ([] = every step)
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Saving(Record):
    """What fixing a cause saves, replayed (docs/findings.md); times in µs."""

    method: str  # replay | joint replay
    per_step_us: float
    share: float  # of baseline_step_us, 0..1
    total_us: float
    marginal_to: list  # the fixes priced before it: the saving is what it adds to them
    baseline_step_us: float  # the replayed unprofiled step the share is of (alone_us, alone_share:
    # what it saves by itself, in ``extra``)
    fixed_step_us: float
    recorded_step_us: float
    unprofiled_step_us: Optional[float]
    by_step_us: dict  # step number (a string in JSON) -> µs
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Claim(Record):
    symptom: str  # a symptom code
    rank: Optional[int]
    us: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Explained(Record):
    """A symptom a cause explains, and how much of it (µs over the analysed steps)."""

    id: str
    code: str
    rank: Optional[int]
    title: str
    explained_us: float
    share: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Cause(Record):
    """One mechanism that costs time, with its place, remedy and replayed saving (docs/findings.md)."""

    code: str
    rank: Optional[int]  # None: job-wide
    title: str  # one line; its numbers are the evidence's
    mechanism: str
    remedy: str
    place: Place
    evidence: dict = field(repr=False)  # per cause code (docs/findings.md)
    claims: list[Claim] = field(repr=False)
    saving: Saving = field(repr=False)
    severity: str  # high | medium | low
    id: str
    symptoms: list[Explained] = field(repr=False)
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Symptom(Record):
    """What the numbers show (recorded time over the analysed steps, µs)."""

    code: str
    rank: Optional[int]
    title: str
    us: float
    per_step_us: float
    share: float  # of the recorded step time, 0..1
    detail: dict = field(repr=False)
    explained_by: list = field(repr=False)  # [{"cause": id, "us": float}]
    unexplained_us: float
    id: str
    orphan: bool  # >= 5 % of the step that no cause explains
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Baseline(Record):
    """One rank's step times that the savings are shares of (µs)."""

    rank: int
    recorded_step_us: float
    unprofiled_step_us: Optional[float]
    replayed_step_us: float
    profiler_cost_scale: float
    host_scale: float
    profiler_cost_us: float
    coupled: bool
    launch_latency_us: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Step(Record):
    """One step of one rank: its window split into compute, exposed communication, exposed memory
    and idle, which add up to ``duration_us`` (docs/metrics.md, "Breakdown")."""

    step: int
    start_ns: int
    duration_us: float
    compute_us: float
    communication_us: float
    memory_us: float
    idle_us: float
    communication_total_us: float
    communication_overlapped_us: float
    memory_total_us: float
    memory_exposed_us: float
    gpu_busy_pct: float
    kernels_launched: int
    gpu_time_launched_us: float
    runtime_us: float
    sync_us: float
    dataloader_us: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class KernelStat(Record):
    name: str
    cls: str
    calls: int
    total_us: float
    mean_us: float
    median_us: float
    p95_us: float
    share_pct: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class RankReport(Record):
    """One rank's analyses; the dict fields are documented in docs/report.md."""

    rank: int
    source: str
    host: str
    device: dict
    step_source: str
    window: dict
    steps: list[Step] = field(repr=False)
    summary: dict = field(repr=False)
    top_kernels: list[KernelStat] = field(repr=False)
    rows: dict = field(repr=False)
    options: dict = field(repr=False)
    kernels: dict = field(repr=False)
    runtime: dict = field(repr=False)
    hotspots: dict = field(repr=False)
    communication: dict = field(repr=False)
    memory: dict = field(repr=False)
    flops: dict = field(repr=False)
    step_diff: Optional[dict] = field(repr=False)
    kernels_other: dict = field(repr=False)
    kernels_by_calls: dict = field(repr=False)
    activity: dict = field(repr=False)
    memops: list = field(repr=False)
    step_within: str
    serving: Optional[dict] = field(repr=False)
    counters: Optional[dict] = field(repr=False)
    native: Optional[dict] = field(repr=False)
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> RankReport:
        """A brief section (a report of many ranks keeps the tables of the ranks it names only:
        docs/report.md, "Ranks in brief") reads with each table None (``brief``)."""
        return super().from_dict({**dict.fromkeys(DETAIL_FIELDS), **d} if is_brief(d) else d)

    @property
    def brief(self) -> bool:
        """Whether the report kept this rank without its tables (a full section's are never None)."""
        return self.top_kernels is None

    def to_dict(self) -> dict:
        out = super().to_dict()
        return {k: v for k, v in out.items() if not (k in DETAIL_FIELDS and v is None)} if self.brief else out


@dataclass
class CaptureInfo(Record):
    world_size: int
    ranks_found: list[int]
    sources: list[str]
    extra: dict = field(default_factory=dict, repr=False)


@dataclass
class Report(Record):
    """The whole report. In a notebook it shows as its causes table (``_repr_html_``)."""

    schema: str
    generator: dict
    capture: CaptureInfo
    ranks: list[RankReport] = field(repr=False)
    cross_rank: Optional[dict] = field(repr=False)
    causes: list[Cause] = field(repr=False)
    symptoms: list[Symptom] = field(repr=False)
    baseline: list[Baseline] = field(repr=False)
    extra: dict = field(default_factory=dict, repr=False)

    def to_json(self) -> str:
        """The JSON report, as ``aiprof analyze --json`` prints it."""
        return json_report.dumps(self.to_dict())

    def _repr_html_(self) -> str:
        return render.causes_table(self)
