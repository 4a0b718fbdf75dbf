"""The roofline per kernel family (analysis/roofline.py) on real H100/H200 traces with shapes, and
the work model of one op call by hand."""
from __future__ import annotations

from pathlib import Path

from aiprof.analysis.roofline import LATENCY_ROOF_SHARE, NO_SHAPES, op_work, roofline
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data"


def _fams(name: str) -> dict:
    r = roofline(open_capture([str(DATA / "diagnosis" / name)]).ranks[0])
    assert r.reason is None, r.reason
    return r, {f.family: f for f in r.families}


def test_op_work_by_hand():
    bf16 = '"c10::BFloat16"'
    # mm [16384, 768] x [768, 3072]: 2MKN FLOPs; reads both, writes M x N, 2 bytes each
    f, b = op_work("aten::mm", "[[16384, 768], [768, 3072]]", f"[{bf16}, {bf16}]")
    assert f == 2 * 16384 * 768 * 3072 and b == 2 * (16384 * 768 + 768 * 3072 + 16384 * 3072)
    # addmm's operands are inputs 1 and 2 (the bias is read too)
    f, b = op_work("aten::addmm", "[[3072], [16384, 768], [768, 3072], [], []]",
                   f'[{bf16}, {bf16}, {bf16}, "Scalar", "Scalar"]')
    assert f == 2 * 16384 * 768 * 3072 and b == 2 * (3072 + 16384 * 768 + 768 * 3072 + 16384 * 3072)
    # elementwise: both inputs read, one output the size of the largest written
    assert op_work("aten::mul", "[[1024, 1024], [1024, 1024]]", '["float", "float"]') == (1024 * 1024, 3 * 4 * 1024 * 1024)
    # copy_: the destination is written, not read
    assert op_work("aten::copy_", "[[1024], [1024], []]", f'["float", {bf16}, ""]') == (1024, 2 * 1024 + 4 * 1024)
    # a reduction writes (almost) nothing
    assert op_work("aten::sum", "[[4096, 8], []]", '["float", "ScalarList"]') == (4096 * 8, 4 * 4096 * 8)
    # flash attention takes [B, L, H, E], cuDNN [B, H, L, E]: the same FLOPs
    q_blhe, q_bhle = "[2, 1024, 12, 64]", "[2, 12, 1024, 64]"
    fl = op_work("aten::_flash_attention_forward", f"[{q_blhe}, {q_blhe}, {q_blhe}]", f"[{bf16}, {bf16}, {bf16}]")
    cu = op_work("aten::_cudnn_attention_forward", f"[{q_bhle}, {q_bhle}, {q_bhle}]", f"[{bf16}, {bf16}, {bf16}]")
    assert fl[0] == cu[0] == 4 * 2 * 12 * 1024 * 1024 * 64
    # no dtyped tensor input (a fused optimizer's tensor lists): unknown, not zero
    assert op_work("aten::_fused_adamw_", "[[], [], []]", '["TensorList", "TensorList", "Scalar"]') is None


def test_gpt2_matmuls_compute_bound_elementwise_memory_bound():
    r, fams = _fams("healthy_gpt2.json.gz")
    assert 50 <= r.covered_pct <= 100  # the fused AdamW (tensor lists) is the part left out
    mm = fams["nvjet (cuBLAS)"]
    assert mm.bound == "compute-bound" and mm.compute_peak == "bf16 tensor cores"
    assert 0.4 <= mm.roof_pct / 100 <= 1.0 and set(mm.ops[:2]) <= {"aten::mm", "aten::addmm"}
    ew = fams["at::native::vectorized_elementwise_kernel"]
    assert ew.bound == "memory-bound" and ew.intensity < 1 and 0.4 <= ew.roof_pct / 100 <= 1.0
    # no family runs above its roof: the work model does not overcount
    assert all(f.roof_pct <= 100 for f in r.families), [(f.family, f.roof_pct) for f in r.families]


def test_fp32_matmul_is_on_the_cuda_core_roof():
    _, fams = _fams("fp32_matmul_fault.json.gz")
    (gemm,) = [f for f in fams.values() if "gemm" in f.family]
    # TF32 off: the fp32 CUDA-core peak is the roof it nearly reaches, 15x below the tf32 roof
    assert gemm.compute_peak == "fp32 CUDA cores" and gemm.bound == "compute-bound" and gemm.roof_pct > 50


def test_head_by_head_softmax_is_latency_bound():
    _, fams = _fams("underfilled_fault.json.gz")
    sm = fams["at::native::cunn_SoftMaxForward"]
    assert sm.bound == "latency-bound" and sm.roof_pct < 100 * LATENCY_ROOF_SHARE


def test_without_shapes_says_why():
    # the stall capture without Python stacks was made with --what kernels: no shapes
    rt = open_capture([str(DATA / "v3" / "stall_fault_nostack")]).ranks[0]
    assert not any(rt.ops.strings("input_dims").labels)
    r = roofline(rt)
    assert r.reason == NO_SHAPES and r.families == [] and r.covered_pct == 0
