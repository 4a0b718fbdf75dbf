"""The serving causes (diagnosis/causes/: decode_launch_bound, small_batch, prefill_stall,
host_scheduling, kv_cache_copy, host_sampling) on the real H100 GPT-2 generate trace and the
real CPU continuous-batching capture with a prompt arriving mid-decode."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.pipeline import analyse_rank as _analyse_rank, build_report
from aiprof.diagnosis.causes import host_sampling, kv_cache_copy
from aiprof.diagnosis.replay import replay
from aiprof.trace.store import open_capture
from tests.serving.support import fixture_rank, rank, truth


@pytest.fixture(scope="module")
def gen_report(tmp_path_factory):
    rt = fixture_rank("scenarios/generate_b1.json.gz", tmp_path_factory.mktemp("gen"))
    return build_report(open_capture(rt.source, show_progress=False))


def _by_code(rep: dict, minor: bool = False) -> dict:
    """The first cause of each code (with ``minor``, those under the report floor too)."""
    out: dict = {}
    for c in rep["causes"] + (rep["minor"] if minor else []):
        out.setdefault(c["code"], c)
    return out


def test_decode_launch_bound(gen_report):
    c = _by_code(gen_report, minor=True)["DECODE_LAUNCH_BOUND"]
    ev = c["evidence"]
    # high alone; priced after SMALL_BATCH, which wins the same idle decode time, it adds little
    assert c["saving"]["alone_share"] >= 0.1 and c["saving"]["marginal_to"] == ["SMALL_BATCH"]
    assert ev["decode_iterations"] == 23 and ev["gpu_busy_share"] < 0.1
    assert ev["engine"] == "transformers generate" and "cache_implementation=\"static\"" in c["remedy"]
    assert "reduce-overhead" in c["remedy"]
    # it claims the decode iterations: the generic LAUNCH_BOUND is priced on what is left
    lb = _by_code(gen_report, minor=True).get("LAUNCH_BOUND")
    assert lb is None or lb["saving"]["alone_share"] < c["saving"]["alone_share"] / 5


def test_small_batch(gen_report):
    c = _by_code(gen_report)["SMALL_BATCH"]
    ev = c["evidence"]
    assert ev["median_batch"] == 1 and 2 <= ev["batch_factor"] <= 16
    # the replay keeps 1 in k decode iterations with k times their GPU work: never more than (k-1)/k
    assert 0.3 < c["saving"]["share"] < (ev["batch_factor"] - 1) / ev["batch_factor"]
    assert "continuous batching" in c["remedy"] and c["severity"] == "high"


def test_host_scheduling_names_the_per_token_python(gen_report):
    # (1.2 % alone; priced after the batching and decode fixes it adds 0.1 %: under minor)
    c = [x for x in gen_report["causes"] + gen_report["minor"] if x["code"] == "HOST_SCHEDULING"]
    assert c, "no HOST_SCHEDULING"
    # model.device walks the parameters on every token, between the forwards
    assert any("modeling_utils.py" in x["evidence"]["function"] and x["evidence"]["calls"] >= 23 for x in c)
    # the one-off set-up of the generate call is not per-iteration work
    assert not any("_prepare_generation_config" in x["evidence"]["function"] for x in c)


def test_kv_cache_concatenation(tmp_path):
    rt = fixture_rank("scenarios/generate_b1.json.gz", tmp_path)
    _, facts = _analyse_rank(rt, None, 15)
    found = kv_cache_copy.detect(facts)
    assert len(found) == 1
    c = found[0]
    # 4 layers x (keys, values) in each of the 23 decode iterations: the trace's 184 cat kernels
    assert c.evidence["concatenations"] == 184 and "static" in c.remedy
    g = facts.graph
    changed = ~np.isnan(c.edit.op_dur)
    assert changed.any() and (c.edit.op_dur[changed] < g.o_dur[changed]).all()
    # host-bound batch-1 decoding: shorter copies save almost nothing (not reported, < 1 %)
    saving = facts.base.per_step_ns - replay(g, c.edit).per_step_ns
    assert 0 <= saving < 0.01 * facts.base.per_step_ns


def test_sampling_on_the_gpu_is_not_host_sampling(tmp_path):
    # generate samples with argmax on the GPU; its device-to-host copies are 8-byte reads
    rt = fixture_rank("scenarios/generate_b1.json.gz", tmp_path)
    _, facts = _analyse_rank(rt, None, 15)
    assert host_sampling.detect(facts) == []


def test_prefill_stalls_decode(captures, tmp_path):
    rt = rank(captures, "cb_stall", tmp_path)
    rep = build_report(open_capture(rt.source, show_progress=False))
    c = _by_code(rep)["PREFILL_STALLS_DECODE"]
    ev = c["evidence"]
    assert ev["stall_iterations"] == 1 and ev["worst_us"] >= 3 * ev["median_decode_us"]
    assert ev["engine"] == "transformers continuous batching" and "max_batch_tokens" in c["remedy"]
    assert ev["chunk_tokens"] < 1024 and ev["predicted_max_inter_token_us"] < ev["max_inter_token_us"]
    # the engine saw the same: one step with the long prompt beside three decoding sequences
    assert sum(1 for s in truth(captures, "cb_stall")["steps"] if s["prefill"] and s["decode"]) == 1
