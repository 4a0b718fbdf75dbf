"""EAGER_ATTENTION and UNFUSED_POINTWISE on their real GPU pairs (tests/data/v3b: the nanoGPT-style
job of bench/diagnosis/v3_job.py at 48 sequences on one H100, captured with `aiprof run --skip 10
--iterations 3 --what kernels,python,shapes`; timings in tests/data/v3b/README.txt), and the
calibration's GPU floor those GPU-bound captures need."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from aiprof.diagnosis import engine
from aiprof.diagnosis.causes import conv_layout, eager_attention, unfused_pointwise
from aiprof.diagnosis.kernel_ops import kernel_ops, largest_input
from aiprof.pipeline import analyse_rank, build_report
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data" / "v3b"
LAYERS, STEPS = 6, 3  # v3_job.py's model and the capture's iterations
SCORES = [48 * 8, 512, 512, 64]  # batch x heads, L, S, head dim


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            d = tmp_path_factory.mktemp(name) / "cap"
            shutil.copytree(DATA / name, d)  # the analysis caches beside the trace: not in the repo
            cache[name] = analyse_rank(open_capture(str(d)).ranks[0], None, 15)[1]
        return cache[name]
    return get


def test_eager_attention_is_found_once_per_layer_and_step_with_its_backward(facts):
    f = facts("attention_fault")
    found = eager_attention.regions(f)
    assert len(found) == LAYERS * STEPS
    assert all(r["shape"] == SCORES and r["masked"] for r in found)
    ops = eager_attention.region_ops(f)
    g = f.graph
    for fwd, bwd in ops:  # forward: the two products, scale, mask, softmax, dropout; backward: more
        assert len(fwd) >= 5 and len(bwd) > len(fwd)
        assert not np.intersect1d(fwd, bwd).size
    # the region's kernels are most of the step: the scores pass through memory once per op
    eager = sum(float(g.o_dur[np.r_[a, b]].sum()) for a, b in ops)
    assert eager > 0.4 * float(g.o_dur.sum())


def test_eager_attention_cause_names_sdpa_and_prices_it_as_the_fused_kernel(facts):
    f = facts("attention_fault")
    (c,) = eager_attention.detect(f)
    assert "scaled_dot_product_attention" in c.remedy and "is_causal=True" in c.remedy
    assert c.place.site.endswith(": attention")
    ev = c.evidence
    assert ev["attentions_per_step"] == LAYERS
    assert 0 < ev["fused_us_per_step"] < 0.2 * ev["eager_us_per_step"]
    assert 50 < ev["tensor_core_tflops"] < 1000  # measured on this trace's own matmuls


def test_sdpa_and_the_written_out_functions_are_not_eager_attention(facts):
    for name in ("attention_fix", "pointwise_fault", "pointwise_fix", "gate_fault"):
        assert eager_attention.regions(facts(name)) == [], name


def test_written_out_gelu_and_layer_norm_are_chains_priced_as_one_pass(facts):
    f = facts("pointwise_fault")
    chains = unfused_pointwise.chains(f)
    assert len(chains) >= 4 * LAYERS * STEPS  # two LayerNorms and a GELU per block, forward and backward
    (c,) = unfused_pointwise.detect(f)
    assert "F.gelu" in c.remedy and "F.layer_norm" in c.remedy and "torch.compile" in c.remedy
    assert any(op in c.evidence["ops"] for op in ("aten::tanh", "aten::pow"))
    assert c.place.site.endswith((": mlp", ": forward"))
    ev = c.evidence
    assert ev["fused_us_per_step"] < 0.25 * ev["chain_us_per_step"]


def test_no_chain_without_written_out_functions_or_on_tiny_tensors(facts):
    assert unfused_pointwise.chains(facts("pointwise_fix")) == []
    assert unfused_pointwise.chains(facts("attention_fix")) == []
    # the attention's own mask and scale kernels belong to EAGER_ATTENTION
    assert unfused_pointwise.chains(facts("attention_fault")) == []
    # the gate's written-out GELU runs over 512 elements: not a full pass of any chain
    f = facts("gate_fault")
    ko = kernel_ops(f)
    for run in unfused_pointwise.chains(f):
        full = ko.numel[run] >= unfused_pointwise.FULL_SHARE * ko.numel[run].max()
        assert ko.numel[run][full].min() > 512


def test_the_pairs_reports_name_their_fault_first_and_the_fixes_do_not(tmp_path):
    for name, first in (("pointwise_fault", "UNFUSED_POINTWISE"), ("attention_fault", "EAGER_ATTENTION")):
        d = tmp_path / name
        shutil.copytree(DATA / name, d)
        rep = build_report(open_capture(str(d)))
        assert rep["causes"][0]["code"] == first
    d = tmp_path / "fix"
    shutil.copytree(DATA / "pointwise_fix", d)
    codes = {c["code"] for c in build_report(open_capture(str(d)))["causes"]}
    assert not codes & {"UNFUSED_POINTWISE", "EAGER_ATTENTION"}


def test_a_measured_step_below_the_gpu_work_is_raised_to_it(facts):
    """The agent timed the iterations before the capture on the host while CUDA's queue filled
    (gate_fault: median 19.6 ms; unprofiled 22.9 ms): the calibration's target is the kernels' floor."""
    f = facts("gate_fault")
    measured = engine.unprofiled_step_ms(f.rt)
    floor = engine.compute_floor_ns(f.rt, f.graph)
    assert measured is not None and measured * 1e6 < floor
    assert f.unprofiled_step_ns == pytest.approx(floor)
    # a host-bound capture keeps its measured step (the floor is far below it)
    g = facts("anomaly_fix")
    assert engine.compute_floor_ns(g.rt, g.graph) <= g.unprofiled_step_ns


def test_largest_input_reads_recorded_shapes():
    assert largest_input("[[48, 512, 2048], [], []]", '["c10::BFloat16", "Scalar", ""]') == (48 * 512 * 2048,
                                                                                             2 * 48 * 512 * 2048)
    assert largest_input("", "") == (0, 0)
    assert largest_input("[[3, 4]]", '["unknown"]') == (12, 0)


def test_channels_first_convolutions_are_their_layout_conversions(facts):
    """The channels pair (a ResNet-18-shaped net, bf16): cuDNN transposes NCHW operands to NHWC and
    back around every convolution; in channels_last there is nothing to convert."""
    f = facts("channels_fault")
    conv = conv_layout.conversions(f)
    assert conv.sum() >= 20 * STEPS  # 20 convolutions, forward and backward
    (c,) = conv_layout.detect(f)
    assert "channels_last" in c.remedy and c.evidence["conversions_per_step"] >= 20
    # with them, ATen's NCHW batch-norm kernels (64 blocks for 64 channels), left to this cause
    assert c.evidence["nchw_batch_norm_kernels_per_step"] >= 40 and c.region.any()
    # channels_last: only the 3-channel stem is still converted (2 of its ~60 convolution calls a step)
    assert conv_layout.conversions(facts("channels_fix")).sum() <= 2 * STEPS
    assert conv_layout.detect(facts("channels_fix")) == []
    assert conv_layout.detect(facts("pointwise_fix")) == []


def test_eager_attention_without_python_stacks(facts):
    """The same fault captured with --what kernels,shapes: the ops' caller is their thread."""
    f = facts("attention_fault_nostack")
    found = eager_attention.regions(f)
    assert len(found) == LAYERS * STEPS and all(r["shape"] == SCORES for r in found)
    (c,) = eager_attention.detect(f)
    assert c.place.site == "" and c.evidence["attentions_per_step"] == LAYERS
