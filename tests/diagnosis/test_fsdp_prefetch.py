"""FSDP_NO_BACKWARD_PREFETCH on its real 4-GPU pair (tests/data/v3b/fsdp1_prefetch_*: v3_job.py's
GPT of six blocks under FSDP1, one unit per block, 48 sequences per rank on 4 H100s, captured with
`aiprof run --skip 10 --iterations 3 --what kernels,python,shapes -- torchrun ...`, trimmed to the
script's frames). Over NCCL sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1),
backward_prefetch=None measured 88.2 ms a step unprofiled and BACKWARD_PRE 77.4 ms (12.2 %, medians
of 3 alternating rounds, the fault slower in each); over NVLink 36.8 against 39.2 ms (noise): the
negative control, fsdp1_prefetch_fault. fsdp1_prefetch_sockets_fix holds rank 0 of the fix.
fsdp1_post_sockets_fault: BACKWARD_POST over sockets, a later call: 95.2 / 109.3 / 105.7 ms against
BACKWARD_PRE's 99.5 / 99.3 / 106.6 (faster in two rounds of three: noise, a negative control)."""
from __future__ import annotations

import numpy as np

from aiprof.diagnosis.causes import fsdp_prefetch
from aiprof.diagnosis.job import joint_replay
from aiprof.pipeline import analyse_rank, build_report

STEPS, BLOCKS = 3, 6
MEASURED = 1 - 77.4 / 88.2
FACTOR = 1.5  # issue 29's target: predicted within 1.5x of measured


def test_each_blocks_backward_gather_is_issued_on_demand_and_can_move_to_the_hook_before(v3b_capture):
    for rt in v3b_capture("fsdp1_prefetch_sockets_fault").ranks:
        f = analyse_rank(rt, None, 15)[1]
        found = fsdp_prefetch.backward_gathers(f)
        g = f.graph
        assert found["prefetched"] == 0 and len(found["ops"]) == BLOCKS * STEPS
        # every one has a hook before it in its step (the root's for the first block): issued earlier
        at = found["at"]
        assert (at >= 0).all() and (at < g.o_action[found["ops"]]).all()
        # the prefetch point of the hook before: before the previous block's reduce-scatter is issued
        assert (np.diff(at.reshape(STEPS, BLOCKS), axis=1) > 0).all()
        assert fsdp_prefetch.has_unprefetched_gathers(f)


def test_with_backward_pre_the_gathers_are_prefetched(v3b_capture):
    f = analyse_rank(v3b_capture("fsdp1_prefetch_sockets_fix").ranks[0], None, 15)[1]
    found = fsdp_prefetch.backward_gathers(f)
    assert found["prefetched"] == BLOCKS * STEPS and not len(found["ops"])
    assert not fsdp_prefetch.has_unprefetched_gathers(f)


def test_backward_post_prefetches_and_nothing_is_said(v3b_capture):
    rep = build_report(v3b_capture("fsdp1_post_sockets_fault"))
    assert fsdp_prefetch.CODE not in [c["code"] for c in rep["causes"] + rep.get("minor", [])]
    for rt in v3b_capture("fsdp1_post_sockets_fault").ranks:
        found = fsdp_prefetch.backward_gathers(analyse_rank(rt, None, 15)[1])
        # from the post-backward hooks, but a step's first (no unit computed before it)
        assert found["prefetched"] == (BLOCKS - 1) * STEPS and len(found["ops"]) == STEPS


def test_the_cause_prices_the_reordered_collectives_near_the_measured_fix(v3b_capture, monkeypatch):
    seen: dict = {}
    detect = fsdp_prefetch.detect_job

    def keep(facts, pricer):
        seen["facts"] = facts
        return detect(facts, pricer)
    monkeypatch.setattr(fsdp_prefetch, "detect_job", keep)
    rep = build_report(v3b_capture("fsdp1_prefetch_sockets_fault"))
    codes = [c["code"] for c in rep["causes"]]
    # the sockets are the larger loss (the same job over NVLink is 58 % faster); the order and the
    # eager model's kernels (UNCOMPILED_KERNEL_RUNS, 14.9 %) next, a tenth of a point apart
    assert codes[0] == "SLOW_INTERCONNECT" and set(codes[1:3]) == {fsdp_prefetch.CODE, "UNCOMPILED_KERNEL_RUNS"}
    c = rep["causes"][codes.index(fsdp_prefetch.CODE)]
    assert c["rank"] is None and c["evidence"]["backward_gathers_per_step"] == BLOCKS
    assert "BackwardPrefetch.BACKWARD_PRE" in c["remedy"]
    assert MEASURED / FACTOR <= c["saving"]["share"] <= MEASURED * FACTOR
    # the fix's replay: each backward all-gather now runs before the reduce-scatter of the block
    # after it, and the collectives still run one at a time (the communicator's order)
    facts = seen["facts"]
    fixed = joint_replay(facts, {f.rank: fsdp_prefetch._edit(f) for f in facts}, traced=True)
    base = joint_replay(facts, traced=True)
    for f in facts:
        comm, _ = fsdp_prefetch._comm_ops(f)
        tr = fixed[f.rank].trace
        start, end = tr.o_ready[comm], tr.o_end[comm]
        order = np.argsort(start)
        assert (start[order][1:] >= end[order][:-1] - 1.0).all()
        # and the all-gathers end sooner (all but a step's first, which had no reduce-scatter before it)
        gathers = fsdp_prefetch.backward_gathers(f)["ops"]
        assert (tr.o_end[gathers] < base[f.rank].trace.o_end[gathers]).sum() >= (BLOCKS - 1) * STEPS


def test_over_nvlink_the_order_costs_nothing_and_nothing_is_said(v3b_capture):
    rep = build_report(v3b_capture("fsdp1_prefetch_fault"))
    assert fsdp_prefetch.CODE not in [c["code"] for c in rep["causes"]]
    # found and priced, below a percent of the step: the collectives are too short to matter
    minor = [c for c in rep.get("minor", []) if c["code"] == fsdp_prefetch.CODE]
    assert minor and minor[0]["saving"]["share"] < 0.01
