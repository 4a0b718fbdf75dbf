"""ZEROED_GRADS on its real CPU pair (bench/diagnosis/cpu_zero_grad.py, captured with `aiprof run
--skip 20 --iterations 3 --what python` by bench/diagnosis/cpu_pair.sh on this 2-core machine;
tests/data/README.md has the timings). The evidence is read from the real traces: the zeroing
ops inside Optimizer.zero_grad and the adds AccumulateGrad runs into the zeroed gradients, only
the first backward pass's under gradient accumulation. No cause is reported on these CPU
traces: there ``set_to_none=True`` measured slower (glibc maps the new gradients fresh), so the
detector speaks only of GPU gradients, and only when asked for while it is experimental."""
from __future__ import annotations

import pytest

from aiprof.diagnosis.causes import zeroed_grads
from aiprof.pipeline import analyse_rank, build_report

PARAMS = 12  # 6 Linear layers: a weight and a bias each


@pytest.fixture(scope="module")
def capture(data_capture):
    return lambda name: data_capture(f"zero_grad_cpu/{name}")


def _facts(cap):
    return analyse_rank(cap.ranks[0], None, 15)[1]


def test_the_zeroing_and_the_accumulating_adds_are_found_every_step(capture):
    f = _facts(capture("fault"))
    zeroing, adds = zeroed_grads._zeroing(f), zeroed_grads._accumulating_adds(f)
    steps = len(f.steps)
    assert steps == 3
    assert zeroing.sum() == PARAMS * steps  # SGD without foreach on the CPU: one aten::zero_ per gradient
    assert adds.sum() == PARAMS * steps
    assert zeroed_grads._first_pass(f, adds, zeroing).sum() == PARAMS * steps  # one backward per step


def test_under_gradient_accumulation_only_the_first_pass_adds_go(capture):
    f = _facts(capture("accum"))
    zeroing, adds = zeroed_grads._zeroing(f), zeroed_grads._accumulating_adds(f)
    steps = len(f.steps)
    assert adds.sum() == 2 * PARAMS * steps  # two backward passes a step, both adding
    first = zeroed_grads._first_pass(f, adds, zeroing)
    assert first.sum() == PARAMS * steps
    t = f.tree
    step_of = f.steps.index_of(t.start)
    for k in range(steps):  # in every step, the first pass's adds all come before the second's
        assert t.start[first & (step_of == k)].max() < t.start[adds & ~first & (step_of == k)].min()


def test_set_to_none_leaves_no_evidence(capture):
    f = _facts(capture("fix"))
    assert not zeroed_grads._zeroing(f).any() and not zeroed_grads._accumulating_adds(f).any()


@pytest.mark.parametrize("name", ["fault", "fix", "accum"])
def test_no_cause_on_cpu_gradients_even_when_asked_for(capture, name, monkeypatch):
    # on the CPU the fix measured slower (23.3 vs 18.2 ms a step): silence is the right answer
    monkeypatch.setenv("AIPROF_EXPERIMENTAL_CAUSES", zeroed_grads.CODE)
    assert zeroed_grads.detect(_facts(capture(name))) == []
    rep = build_report(capture(name))
    assert not any(x["code"] == zeroed_grads.CODE for x in rep["causes"] + rep["minor"])


def _as_if_on_a_gpu(f):
    """The same facts with the GPU gate open: the evidence and pricing path on a real trace."""
    import dataclasses

    return dataclasses.replace(f, has_gpu=True)


def test_with_the_gate_open_the_cause_is_priced_from_its_evidence(capture):
    [c] = zeroed_grads.detect(_as_if_on_a_gpu(_facts(capture("fault"))))
    ev = c.evidence
    assert ev["zeroing_ops"] == PARAMS * 3 and ev["adds_removed"] == PARAMS * 3 == ev["accumulating_adds"]
    assert c.place.site.startswith("cpu_zero_grad.py(") and "set_to_none=True" in c.remedy
    assert c.edit.gap_remove.sum() > 0  # their host time (on a CPU trace all of it lies between replay actions)


def test_with_the_gate_open_accumulation_prices_only_the_first_pass(capture):
    [c] = zeroed_grads.detect(_as_if_on_a_gpu(_facts(capture("accum"))))
    assert c.evidence["accumulating_adds"] == 2 * PARAMS * 3 and c.evidence["adds_removed"] == PARAMS * 3
    assert zeroed_grads.detect(_as_if_on_a_gpu(_facts(capture("fix")))) == []
