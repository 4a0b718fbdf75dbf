"""GRAD_ACCUM_ALLREDUCE on FSDP2 (tests/data/v3b/fsdp_accum_*: v3_job.py's GPT of six blocks, fully_shard
per block and the root, 4 micro-batches of 12 sequences per optimizer step, 2 H200s, captured with `aiprof
run --skip 10 --iterations 3 --what kernels,python,shapes -- torchrun ...`, trimmed to the script's frames
and run_backward). Over NCCL sockets every micro-batch reduce-scattering measured 205.3 ms a step
unprofiled and set_requires_gradient_sync(False) but for the last 149.2 ms (27.3 %, medians of 5
alternating rounds, the fault slower in each; 31.4 and 18.0 % in two calls of 3 rounds); over NVLink
113.0 against 114.5 ms (noise): the negative control, fsdp_accum_fault (tests/data/v3b/README.txt,
session 19)."""
from __future__ import annotations

import numpy as np

from aiprof.analysis.ranks import rank_collectives
from aiprof.diagnosis.causes import grad_accum
from aiprof.pipeline import analyse_rank, build_report

STEPS, MICRO, UNITS = 3, 4, 7  # six blocks and the root
MEASURED = 1 - 149.2 / 205.3
# two processes on one host share a clock: matched a micro-batch apart they were offset by ~72 ms
ALIGNED_US = 1000.0
FACTOR = 1.5  # issue 29's target: predicted within 1.5x of measured


def test_only_the_reduce_scatters_of_the_passes_before_a_steps_last_are_skipped(v3b_capture):
    for rt in v3b_capture("fsdp_accum_fault_sockets").ranks:
        f = analyse_rank(rt, None, 15)[1]
        e, found = grad_accum.skippable_edit(f)
        assert found["passes"] == MICRO and found["framework"] == "fsdp2" and found["kind"] == "ReduceScatter"
        assert found["reductions"] == MICRO * UNITS and found["skipped"] == (MICRO - 1) * UNITS
        # nothing but reduce-scatters goes: the all-gathers of every micro-batch's forward and backward stay
        red, _ = grad_accum._reduction_ops(f)
        assert e.drop_op.any() and not (e.drop_op & ~red).any()
        # what FSDP keeps unsharded between micro-batches: a step's last reduce-scatters' inputs
        assert found["unsharded_bytes"] > 0


def test_the_same_collective_is_numbered_by_the_step_that_launched_it_on_every_rank(v3b_capture):
    """Over sockets one rank's GPU runs a micro-batch behind its host: numbered by the step their
    kernels ran in, its last micro-batch's collectives fell outside the window and the ranks were
    matched a micro-batch apart (20 collectives), so no edit of one micro-batch could be made on both."""
    colls = [rank_collectives(rt) for rt in v3b_capture("fsdp_accum_fault_sockets").ranks]
    for c in colls:
        assert (np.bincount(c.step - c.step.min()) == len(c) // STEPS).all()
    al = build_report(v3b_capture("fsdp_accum_fault_sockets"))["cross_rank"]["alignment"]
    # every collective matched, on clocks that agree to a fraction of a micro-batch (~70 ms)
    assert al["matched"] == {"0": len(colls[0]), "1": len(colls[1])}
    assert abs(al["offset_us"]["1"]) < ALIGNED_US and al["spread_us"]["1"] < ALIGNED_US


def test_the_accumulation_is_priced_near_the_measured_fix_after_the_sockets(v3b_capture):
    rep = build_report(v3b_capture("fsdp_accum_fault_sockets"))
    codes = [c["code"] for c in rep["causes"]]
    # the sockets are the larger loss (SLOW_INTERCONNECT), the accumulation the next
    assert codes[:2] == ["SLOW_INTERCONNECT", grad_accum.CODE]
    c = rep["causes"][1]
    assert c["rank"] is None and "set_requires_gradient_sync(False)" in c["remedy"] and "no_sync" not in c["remedy"]
    assert "reduce-scatters" in c["title"] and "MiB per rank" in c["remedy"]
    assert MEASURED / FACTOR <= c["saving"]["share"] <= MEASURED * FACTOR


def test_over_nvlink_the_hidden_reduce_scatters_are_not_a_cause(v3b_capture):
    rep = build_report(v3b_capture("fsdp_accum_fault"))
    assert grad_accum.CODE not in [c["code"] for c in rep["causes"]]


def test_fsdp1_is_told_no_sync_and_fsdp2_set_requires_gradient_sync(v3b_capture):
    """The remedy follows the framework the trace shows (FSDP1's own annotations on the FSDP1 pair
    without accumulation; its accumulation pair measured 18.2 %, priced 19.2 %, not committed)."""
    f1 = analyse_rank(v3b_capture("fsdp1_prefetch_fault").ranks[0], None, 15)[1]
    f2 = analyse_rank(v3b_capture("fsdp_accum_fault").ranks[0], None, 15)[1]
    assert grad_accum._framework(f1) == "fsdp1" and grad_accum._framework(f2) == "fsdp2"
    assert "model.no_sync()" in grad_accum._remedy("fsdp1", 0.0)
    assert "set_requires_gradient_sync(False)" in grad_accum._remedy("fsdp2", 0.0)
    # no accumulation there: one backward pass a step, nothing to skip
    assert grad_accum.skippable_edit(f1)[0] is None
