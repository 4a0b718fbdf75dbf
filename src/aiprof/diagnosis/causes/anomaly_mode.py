"""ANOMALY_MODE: autograd's anomaly detection left on in a training job.

Mechanism: ``torch.autograd.set_detect_anomaly(True)`` (or ``with detect_anomaly():``) makes
autograd record the Python stack of every node it creates in forward (torch's
``PyAnomalyMetadata::store_stack`` calls ``torch.fx.traceback.format_stack``), and, with
``check_nan`` (its default), check every output of every backward function for NaN: the engine
runs ``isnan(output)._is_any_true().item()`` (torch/csrc/autograd/engine.cpp), a host read per
output, which on a GPU waits for everything queued before it. It is a debugging aid; PyTorch's
Performance Tuning Guide lists it under "disable debugging APIs".

Evidence: inside ``autograd::engine::evaluate_function`` regions, ``aten::isnan`` followed by
``aten::_is_any_true`` and ``aten::item`` (the engine's check; user code never runs between a
backward function and its own check), in most steps; with Python stacks, ``format_stack``
frames called from inside an op (not from Python: torch.fx's own tracing calls it from Python).
Fix priced: the checks' and the stack captures' host time removed, the checks' reads no longer
wait, their kernels not run. Anomaly mode's other costs (metadata kept per node) have no event
in a trace and are not priced: the saving is a lower bound.
"""
from __future__ import annotations

import re

import numpy as np

from aiprof.analysis.hotspots import ANNOTATION, OP, PYTHON
from aiprof.diagnosis.causes.common import (biggest_node, idle_claim, ms, outermost, removal_edit, site_and_stack,
                                            steps_with)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "ANOMALY_MODE"
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
#: The engine's NaN check of one output, in the order it runs (engine.cpp, call_function).
_NAN_CHECK = ("aten::isnan", "aten::_is_any_true", "aten::item")
_STACK_CAPTURE = re.compile(r"torch/fx/traceback\.py\(\d+\): format_stack$")
#: Checks in at least this share of the steps: anomaly mode on for the loop, not a one-off
#: ``with detect_anomaly():`` around one debugging step.
RECURRING_SHARE = 0.5


def _nan_checks(f: RankFacts) -> np.ndarray:
    """Mask of the op nodes that are the engine's NaN checks: each run of the three ops of
    ``_NAN_CHECK``, in that order, as direct children of a backward node."""
    t = f.tree
    out = np.zeros(len(t), dtype=bool)
    backward = f.node_mask(lambda s: s.startswith(_BACKWARD_NODE), (OP, ANNOTATION))
    if not backward.any():
        return out
    ops = np.nonzero(t.kind == OP)[0]
    par = t.parent[ops]
    kids = ops[(par >= 0) & backward[np.maximum(par, 0)]]
    if not len(kids):
        return out
    kids = kids[np.lexsort((t.start[kids], t.parent[kids]))]  # by backward node, then in time
    names = [t.labels[c] for c in t.code[kids]]
    parents = t.parent[kids]
    for i in range(len(kids) - 2):
        if tuple(names[i:i + 3]) == _NAN_CHECK and parents[i] == parents[i + 1] == parents[i + 2]:
            out[kids[i:i + 3]] = True
    return out


def _stack_captures(f: RankFacts) -> np.ndarray:
    """Mask of anomaly mode's stack captures: ``format_stack`` frames whose caller is an op."""
    t = f.tree
    frames = f.node_mask(lambda s: bool(_STACK_CAPTURE.search(s)), (PYTHON,))
    idx = np.nonzero(frames)[0]
    if len(idx):
        par = t.parent[idx]
        frames[idx[(par < 0) | (t.kind[np.maximum(par, 0)] == PYTHON)]] = False
    return frames


def detect(f: RankFacts) -> list[Cause]:
    checks = _nan_checks(f)
    captures = _stack_captures(f)
    roots = checks | captures
    if not roots.any():
        return []
    per = max(len(f.steps), 1)
    steps = steps_with(f, roots)
    if len(steps) < max(1, RECURRING_SHARE * len(f.steps)):
        return []
    tops = outermost(f, roots)
    region = f.under(tops)
    # on a GPU: the reads' copies and syncs, the checks' launches; no longer waited for either
    e, acts = removal_edit(f, tops, CODE, acts=f.actions_in(f.under(checks)))
    e.no_wait[acts] = True
    t = f.tree
    n_checks = int(checks.sum()) // len(_NAN_CHECK)
    n_captures = int(captures.sum())
    check_ns = float((t.end[checks] - t.start[checks]).sum())
    cap_tops = outermost(f, captures)
    capture_ns = float((t.end[cap_tops] - t.start[cap_tops]).sum())
    node = biggest_node(f, checks if checks.any() else captures)
    site, stack = site_and_stack(f, node)
    # a read of the check's result waits for the GPU only where there is one
    read = "a blocking read" if f.has_gpu else "a read of its result on the host"
    parts = []
    if n_checks:
        parts.append(f"{n_checks / per:.0f} NaN checks per step in backward, each {read} "
                     f"({ms(check_ns / per)} of host time)")
    if n_captures:
        parts.append(f"{n_captures / per:.0f} Python stack captures per step in forward ({ms(capture_ns / per)})")
    elif n_checks:
        parts.append("plus a Python stack captured per forward op (not in this trace: "
                     "`aiprof run --what python` shows them)")
    return [Cause(
        code=CODE, rank=f.rank,
        title="autograd anomaly detection is on: " + "; ".join(parts),
        mechanism=("Anomaly mode records the Python stack of every autograd node created in forward and checks "
                   "every backward output for NaN with isnan(...).any().item(), once per output: a read of the result "
                   "on the host, which on a GPU waits for everything queued before it."),
        remedy=("Turn anomaly detection off for training: remove torch.autograd.set_detect_anomaly(True) or the "
                "`with torch.autograd.detect_anomaly():` block (PyTorch Performance Tuning Guide: disable "
                "debugging APIs). To catch NaNs cheaply, check the loss once every N steps "
                "(torch.isfinite(loss)), and turn anomaly mode on only to find where one first appears."),
        place=Place("op", "autograd anomaly detection", site, stack),
        evidence={"nan_checks": n_checks, "nan_checks_per_step": n_checks / per,
                  "stack_captures": n_captures, "stack_captures_per_step": n_captures / per,
                  "host_us_in_checks": check_ns / 1e3, "host_us_in_stack_captures": capture_ns / 1e3,
                  "steps_with_checks": steps},
        edit=e, region=region, claims=idle_claim(f, region) if f.has_gpu else [])]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "steps", "tree"), detect=detect)
