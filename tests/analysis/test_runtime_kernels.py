"""Runtime (syncs, launch delay) and kernel (tensor cores, precision, families) analyses."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.analysis.kernels import (
    PRECISION_FROM_NAME,
    PRECISION_FROM_OP,
    is_matmul_kernel,
    is_tensor_core_kernel,
    kernel_analysis,
    kernel_family,
    kernel_precision,
    kernel_precisions,
    name_precision,
    op_input_precision,
)
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.runtime import launch_delay, runtime_analysis
from aiprof.trace.store import open_capture


def test_runtime_calls_and_sync_sites(gpt2):
    ra = runtime_analysis(gpt2, top=50)
    calls = {c.name: c for c in ra.calls}
    assert calls["cudaDeviceSynchronize"].calls == 11
    assert calls["cudaLaunchKernel"].calls == 4790
    for c in ra.calls:
        assert 0 <= c.gpu_idle_us <= c.total_us + 1e-6
    sites = {(s.call, s.site): s for s in ra.syncs}
    timed = sites[("cudaDeviceSynchronize", "gpt_train.py(48): timed")]
    assert timed.calls == 11 and timed.op == ""
    assert timed.stack[-1] == "<built-in function _cuda_synchronize>"
    # what removing a sync can save is bounded by both the wait and the GPU idle after it
    for s in ra.syncs:
        assert s.stall_us <= min(s.host_wait_us, s.gpu_idle_after_us) + 1e-6
    # the 5 input copies in get_batch block on cudaStreamSynchronize inside aten::copy_
    gb = sites[("cudaStreamSynchronize", "gpt_train.py(22): get_batch")]
    assert gb.calls == 5 and gb.op == "aten::copy_"


def test_launch_delay(gpt2):
    d = launch_delay(gpt2)
    k = gpt2.kernels
    lr = launch_rows(gpt2.runtime, k)
    assert d["count"] == int((lr >= 0).sum()) == len(k)
    delays = (k["ts"] - gpt2.runtime["ts"][lr]) / 1000.0
    assert d["p50"] == pytest.approx(float(np.percentile(delays, 50)))
    assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"]


def test_ddp_input_copy_sync(ddp):
    ra = runtime_analysis(ddp.rank(0))
    top = ra.syncs[0]
    assert (top.call, top.op, top.site) == ("cudaStreamSynchronize", "aten::copy_", "ddp_train.py(24): step")
    assert top.steps == [1, 2, 3, 4]


@pytest.mark.parametrize("name,mm,tc,prec", [
    ("void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1>(cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1::Params)", True, True, "bf16"),
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT", True, True, ""),
    ("volta_sgemm_128x64_nn", True, False, "fp32"),
    ("ampere_sgemm_32x128_tn", True, False, "fp32"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(float)", True, False, "fp32"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)", False, False, ""),
    ("cutlass_80_simt_sgemm_128x128_8x4_nn_align1", True, False, "fp32"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)", False, False, "fp32"),
])
def test_kernel_name_classes(name, mm, tc, prec):
    assert is_matmul_kernel(name) is mm
    assert is_tensor_core_kernel(name) is tc
    if mm:
        assert kernel_precision(name) == prec


def test_kernel_family():
    assert kernel_family("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*)") == \
        "at::native::cunn_SoftMaxForward"
    assert kernel_family("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT") == "nvjet (cuBLAS)"


def test_gpt2_kernel_analysis(gpt2):
    ka = kernel_analysis(gpt2, n_steps=5)
    assert ka.non_tc_matmul_us == 0.0  # every GEMM is a bf16 tensor-core kernel under autocast
    assert ka.tensor_core_us == pytest.approx(ka.matmul_us)
    assert 40.0 < ka.tensor_core_pct_of_compute < 45.0
    # the trace has fp32 addmm rows (autocast wrappers) ...
    o = gpt2.ops
    fp32_addmm = (o["name"] == "aten::addmm") & np.array([t.startswith('["float"') for t in o["input_types"]])
    assert fp32_addmm.sum() == 240
    # ... which launch nothing themselves, so they are not counted as fp32 matmuls
    assert ka.op_precision == {"bf16": 735} and ka.fp32_matmul_ops == []
    assert ka.by_op[0].op == "aten::mm"
    assert ka.launches_per_step == 1153.0
    assert sum(f["share_pct_of_compute"] for f in ka.families) <= 100.0 + 1e-6


def test_cpu_trace_kernels_empty(tmp_path):
    from _diag import tiny_trace

    rt = open_capture(str(tiny_trace(tmp_path))).ranks[0]
    ka = kernel_analysis(rt)
    assert ka.gpu_time_us == 0.0 and ka.families == []
    ra = runtime_analysis(rt)
    assert ra.calls == [] and ra.syncs == [] and ra.launch_delay_us["count"] == 0


@pytest.mark.parametrize("name,prec", [
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT", "bf16"),  # cuBLAS type letters: t = bf16
    ("nvjet_sm90_hsh_128x128_64x6_2x1_v_bz_TNT", "fp16"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "fp32"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "bf16"),
    # the first element type named is the data type; float here is the math type
    (("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
      "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, float)"), "bf16"),
    # FusedAdam names double (its lr) after float (its parameters)
    (("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
      "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
      "(at::native::ADAM_MODE)1, false>, double*, double, double>(double)"), "fp32"),
    # types in the parameter list are not the kernel's data type; integer types are not used
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, std::array<char*, 1ul> >(int, float)", ""),
    (("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
      "unsigned int, 4, 64, 64>(float)"), ""),
])
def test_name_precision(name, prec):
    assert name_precision(name) == prec


def test_op_input_precision():
    assert op_input_precision('["c10::BFloat16", "c10::BFloat16", "Scalar"]') == "bf16"
    assert op_input_precision('["long int", "float", ""]') == "fp32"  # embedding: indices, then weights
    assert op_input_precision('["long int", "Scalar"]') == "int"
    assert op_input_precision('["TensorList", "Scalar"]') == ""
    assert op_input_precision("") == ""


def test_precision_of_every_kernel_on_real_traces(gpt2, ddp4_dir):
    """Unknown precision stays under 5 % of kernel time on the H200 traces (issue 17)."""
    ka = kernel_analysis(gpt2)
    total = sum(ka.kernel_precision_us.values())
    assert total == pytest.approx(ka.gpu_time_us)
    assert ka.kernel_precision_us.get("unknown", 0.0) <= 0.05 * total
    assert sum(ka.kernel_precision_source_us.values()) == pytest.approx(total)
    prec, src = kernel_precisions(gpt2)
    names = gpt2.kernels.strings("name")
    nvjet = names.isin_labels(lambda s: s.startswith("nvjet"))
    # every nvjet GEMM runs under a BFloat16 aten::mm/addmm: the op's dtype decides
    assert set(prec[nvjet]) == {"bf16"} and set(src[nvjet]) == {PRECISION_FROM_OP}
    # cuDNN's attention kernels say "f16" but run under bf16 attention ops
    sdpa = names.isin_labels(lambda s: "sdpa" in s)
    assert sdpa.any() and set(prec[sdpa]) == {"bf16"}
    # the matmul precision no longer has an "unknown" share (nvjet names used to be unknown)
    assert "unknown" not in ka.precision_us and ka.precision_us["bf16"] == pytest.approx(ka.matmul_us)
    # a capture without op dtypes (record_shapes off for these ops): names alone still say
    for path in sorted(ddp4_dir.glob("*.json.gz")):
        rt = open_capture(str(path)).ranks[0]
        kp = kernel_analysis(rt).kernel_precision_us
        assert kp.get("unknown", 0.0) <= 0.05 * sum(kp.values()), (path.name, kp)
        p, s = kernel_precisions(rt)
        assert (s == PRECISION_FROM_NAME).sum() + (p == "").sum() == len(p)
