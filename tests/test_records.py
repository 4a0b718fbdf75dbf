"""records.as_dict: the dict dataclasses.asdict makes, without copying immutable leaves."""
from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from aiprof import pipeline
from aiprof.diagnosis import engine
from aiprof.records import as_dict
from aiprof.trace.store import ingest

DATA = Path(__file__).resolve().parent / "data"
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Inner:
    name: str
    values: list
    arr: np.ndarray


@dataclasses.dataclass
class Outer:
    inner: Inner
    by_key: dict
    pair: Pair
    tup: tuple
    counts: collections.OrderedDict
    scalar: np.float64
    nothing: None = None
    flag: bool = True


def _outer() -> Outer:
    counts = collections.OrderedDict({"x": [2]})
    return Outer(Inner("n", [1, 2.5, {"k": [3]}], np.arange(3)), {(1, 2): Inner("m", [], np.zeros(1)), "s": "t"},
                 Pair([1], {"a": Inner("p", [None], np.ones(2))}), (1, [2], "3"), counts, np.float64(1.5))


def _equal(a: object, b: object) -> bool:
    """Equal, type for type (numpy arrays by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_same_as_asdict_type_for_type():
    obj = _outer()
    mine, theirs = as_dict(obj), dataclasses.asdict(obj)
    assert _equal(mine, theirs)
    assert type(mine["pair"]) is Pair and type(mine["counts"]) is collections.OrderedDict
    assert type(mine["scalar"]) is np.float64


def test_a_defaultdict_keeps_its_factory():
    """(Python 3.11's asdict cannot rebuild one; 3.12's keeps the factory, as this does.)"""
    @dataclasses.dataclass
    class Counted:
        counts: collections.defaultdict

    d = as_dict(Counted(collections.defaultdict(list, {"x": [1]})))["counts"]
    assert type(d) is collections.defaultdict and d.default_factory is list and d == {"x": [1]}


def test_independent_of_the_object():
    """Containers are new and anything mutable is copied, as asdict's are."""
    obj = _outer()
    d = as_dict(obj)
    d["inner"]["values"][2]["k"].append(4)
    d["inner"]["arr"][0] = 99
    d["by_key"][(1, 2)]["values"].append(1)
    assert obj.inner.values[2]["k"] == [3] and obj.inner.arr[0] == 0 and obj.by_key[(1, 2)].values == []
    assert d["inner"]["name"] is obj.inner.name  # an immutable leaf: handed over


def test_exclude_and_bad_input():
    obj = _outer()
    assert list(as_dict(obj, exclude=("inner", "counts"))) == ["by_key", "pair", "tup", "scalar", "nothing", "flag"]
    with pytest.raises(TypeError, match="dataclass instance"):
        as_dict({"a": 1})
    with pytest.raises(TypeError, match="dataclass instance"):
        as_dict(Outer)


def test_a_real_rank_section_and_its_causes():
    """On a committed trace (the 4-rank job's straggler): its report section, causes and
    symptoms convert as asdict converts them."""
    rt = ingest(str(DATA / "ddp4_slow2_rank2.json.gz"))
    rep, facts = pipeline.analyse_rank(rt)
    summary = pipeline.rank_stage(facts, engine.Pricer([facts], False), False)
    assert summary.causes and summary.symptoms
    assert _equal(as_dict(rep), dataclasses.asdict(rep))
    for c in summary.causes:
        theirs = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("edit", "region")}
        assert _equal(engine.cause_dict(c), theirs)
    for s in summary.symptoms:
        assert _equal(as_dict(s), dataclasses.asdict(s))
