"""MISALIGNED_MATMUL on its real GPU pair (tests/data/v3b/vocab_*: the nanoGPT-style job of
bench/diagnosis/v3_job.py with GPT-2's vocabulary of 50257 tokens, then padded to 50304, on one
H100, captured with `aiprof run --skip 10 --iterations 3 --what kernels,python,shapes`; measured
70.72 -> 44.67 ms a step unprofiled, tests/data/v3b/README.txt), and a transformers GPT-2 with
eager attention (hfattn_*) for EAGER_ATTENTION on a model file it was not written against."""
from __future__ import annotations


from aiprof.diagnosis.causes import matmul_alignment
from aiprof.pipeline import analyse_rank, build_report

STEPS = 3
VOCAB_MEASURED = 1 - 44.67 / 70.72
HFATTN_MEASURED = 1 - 24.03 / 43.75


def within(pred: float, meas: float, factor: float = 1.5) -> bool:
    return meas / factor <= pred <= meas * factor


def test_kernel_names_give_the_operand_alignment():
    assert matmul_alignment.misaligned(
        "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1>(Params)")
    assert not matmul_alignment.misaligned(
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)")
    assert not matmul_alignment.misaligned("cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4")  # fp32: 16 bytes
    assert matmul_alignment.misaligned("cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align2")
    assert not matmul_alignment.misaligned("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT")  # no tag: no claim
    assert not matmul_alignment.misaligned("void at::native::vectorized_elementwise_kernel<8, copy_align1>")


def test_the_lm_head_of_50257_tokens_is_three_slow_products_a_step(v3b_capture):
    f = analyse_rank(v3b_capture("vocab_fault").ranks[0], None, 15)[1]
    calls = matmul_alignment._calls(f)
    bad = [c for c in calls.values() if c["bad"]]
    # the head's forward product and its two backward ones (input and weight gradients), every step
    assert len(bad) == 3 * STEPS
    assert all(50257 in matmul_alignment._odd_dims(c["dims"]) for c in bad)
    assert not any(c["bad"] for c in calls.values() if 50257 not in matmul_alignment._odd_dims(c["dims"]))


def test_the_cause_names_the_dimension_and_its_saving_is_the_measured_one(v3b_capture):
    rep = build_report(v3b_capture("vocab_fault"))
    c = rep["causes"][0]
    assert c["code"] == matmul_alignment.CODE
    assert "dimension 50257 not a multiple of 8" in c["title"] and "50304" in c["remedy"]
    assert c["evidence"]["odd_dims"] == [50257]
    assert within(c["saving"]["share"], VOCAB_MEASURED)


def test_the_padded_vocabulary_is_aligned(v3b_capture):
    f = analyse_rank(v3b_capture("vocab_fix").ranks[0], None, 15)[1]
    assert not any(c["bad"] for c in matmul_alignment._calls(f).values())
    rep = build_report(v3b_capture("vocab_fix"))
    assert matmul_alignment.CODE not in {c["code"] for c in rep["causes"] + rep["minor"]}


def test_transformers_eager_attention_is_found_in_a_model_file_it_was_not_written_against(v3b_capture):
    rep = build_report(v3b_capture("hfattn_fault"))
    c = rep["causes"][0]
    assert c["code"] == "EAGER_ATTENTION" and c["evidence"]["attentions_per_step"] == 6
    assert 'attn_implementation="sdpa"' in c["remedy"]
    assert within(c["saving"]["share"], HFATTN_MEASURED)
    fix = build_report(v3b_capture("hfattn_fix"))
    assert "EAGER_ATTENTION" not in {x["code"] for x in fix["causes"] + fix["minor"]}
