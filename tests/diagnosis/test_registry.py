"""The one registry: every cause module is in it, once, and declares what it reads truthfully
enough to be checked (the names exist)."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from aiprof.diagnosis import causes
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts

# Helpers shared by the cause modules, not causes.
HELPERS = {"common", "serving_common"}


def _cause_modules():
    for m in pkgutil.iter_modules(causes.__path__):
        if m.name not in HELPERS:
            yield importlib.import_module(f"{causes.__name__}.{m.name}")


def test_every_cause_module_is_registered():
    registered = {id(d) for d in causes.REGISTRY}
    for mod in _cause_modules():
        mine = [v for v in vars(mod).values() if isinstance(v, Detector)]
        assert mine, f"{mod.__name__} declares no DETECTOR"
        assert all(id(d) in registered for d in mine), f"{mod.__name__}: a detector missing from REGISTRY"
        assert all(d.code == mod.CODE for d in mine)


def test_registry_is_well_formed():
    assert len({id(d) for d in causes.REGISTRY}) == len(causes.REGISTRY)
    for scope in Scope:  # one detector per code within a scope
        codes = [d.code for d in causes.REGISTRY if d.scope == scope]
        assert len(codes) == len(set(codes)), scope
    rank_fields = {f.name for f in dataclasses.fields(RankFacts)}
    job_fields = {f.name for f in dataclasses.fields(JobFacts)}
    for d in causes.REGISTRY:
        known = rank_fields if d.scope in (Scope.RANK, Scope.UNCOUPLED) else job_fields
        assert d.reads and set(d.reads) <= known, (d.code, set(d.reads) - known)
        assert d.every_rank is None or d.scope == Scope.JOB
        assert not d.acts_on or d.scope == Scope.RANK
    # the generic remedy is priced after every specific rank cause: it runs last among them, but
    # for the one that reads what all the others found (the unclaimed leaves), which runs after it
    rank = [d for d in causes.REGISTRY if d.scope == Scope.RANK and not d.last]
    assert [d.generic for d in rank] == [False] * (len(rank) - 1) + [True]
    assert [d.code for d in causes.REGISTRY if d.last] == ["UNEXPLAINED"] and causes.REGISTRY[-1].last


def test_experimental_detectors_run_only_when_asked():
    job = causes.detectors(Scope.JOB, frozenset())
    assert all(not d.experimental for d in job)
    asked = causes.detectors(Scope.JOB, frozenset({"EXPOSED_BUCKET_COMM"}))
    assert [d.code for d in asked if d.experimental] == ["EXPOSED_BUCKET_COMM"]
