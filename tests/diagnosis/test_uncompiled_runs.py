"""UNCOMPILED_KERNEL_RUNS on its real pairs (tests/data/v3b/compile_*: v3_job.py's eager jobs
against the same model under torch.compile(model), one H100 each, captured with `aiprof run --skip
10 --iterations 3 --what kernels,python,shapes`, trimmed to the script's frames). Unprofiled
medians of 3 alternating rounds (README.txt there): the nanoGPT-style model 21.34 -> 15.75 ms, the
channels_last ResNet 21.86 -> 16.33 ms, transformers' GPT-2 (sdpa) 22.11 -> 20.00 ms, the last
with its attention kernels 2.2x slower compiled (SDPA given a dense causal mask)."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.diagnosis.causes import uncompiled_runs, unfused_pointwise
from aiprof.pipeline import analyse_rank, build_report

FACTOR = 1.5  # issue 29's target: predicted within 1.5x of measured
MEASURED = {"compile_fault": 1 - 15.75 / 21.34, "compile_resnet_fault": 1 - 16.33 / 21.86,
            "compile_hf_fault": 1 - 20.00 / 22.11}


def _cause(rep: dict) -> dict | None:
    return next((c for c in rep["causes"] if c["code"] == uncompiled_runs.CODE), None)


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_the_eager_models_kernels_are_priced_as_compiling_them_saved(v3b_capture, name):
    rep = build_report(v3b_capture(name))
    c = rep["causes"][0]
    assert c["code"] == uncompiled_runs.CODE and "torch.compile(model)" in c["remedy"]
    assert MEASURED[name] / FACTOR <= c["saving"]["share"] <= MEASURED[name] * FACTOR
    ev = c["evidence"]
    assert ev["runs_per_step"] >= 40 and ev["fused_us_per_step"] < ev["run_us_per_step"]


def test_transformers_sdpa_compiled_is_priced_with_its_dense_mask(v3b_capture):
    """transformers skips SDPA's mask only when not traced: compiled, the mask is dense and the
    attention kernels lose their causal block skipping. The price carries it; the remedy says so."""
    hf = _cause(build_report(v3b_capture("compile_hf_fault")))
    assert hf["evidence"]["dense_mask_attention_us_per_step"] > 500 and "dense causal mask" in hf["remedy"]
    nano = _cause(build_report(v3b_capture("compile_fault")))  # its own SDPA call, no transformers
    assert nano["evidence"]["dense_mask_attention_us_per_step"] == 0 and "mask" not in nano["remedy"]
    f = analyse_rank(v3b_capture("compile_hf_fault").ranks[0], None, 15)[1]
    masked = uncompiled_runs.causal_sdpa_in_transformers(f)
    ko = uncompiled_runs.kernel_ops(f)
    fams = {ko.family_labels[c] for c in ko.family_code[masked].tolist()}
    assert fams and all("sdpa" in x or "cudnn" in x for x in fams)  # the attention kernels, forward and backward


@pytest.mark.parametrize("name", ["compile_fix", "compile_hf_fix"])
def test_a_compiled_model_is_quiet(v3b_capture, name):
    rep = build_report(v3b_capture(name))
    assert _cause(rep) is None and rep["verdict"]["healthy"]


def test_without_python_stacks_no_module_is_known_and_no_run_is_claimed(v3b_capture):
    f = analyse_rank(v3b_capture("attention_fault_nostack").ranks[0], None, 15)[1]
    assert not uncompiled_runs.in_modules(f).any() and uncompiled_runs.runs(f) == []


def test_the_loss_and_the_optimizer_are_left_out_and_written_out_chains_are_not_counted_twice(v3b_capture):
    f = analyse_rank(v3b_capture("pointwise_fault").ranks[0], None, 15)[1]
    found = np.concatenate(uncompiled_runs.runs(f))
    chains = np.concatenate(unfused_pointwise.chains(f))
    assert len(found) and not np.isin(found, chains).any()
    names = {f.tree.name(int(n)) for n in uncompiled_runs.kernel_ops(f).op_node[found] if n >= 0}
    # the loss (cross_entropy, outside the model) and AdamW's kernels stay eager under torch.compile(model)
    assert not {"aten::_log_softmax", "aten::nll_loss_forward", "aten::_fused_adamw_"} & names
    assert not [x for x in names if "foreach" in x]
