"""MATMUL_OFF_TENSOR_CORES: fp32 matrix products on the CUDA cores.

Mechanism: with fp32 inputs and TF32 disabled (PyTorch's default for matmul), cuBLAS runs
SIMT kernels at the CUDA cores' rate, about a seventh of the tensor cores' TF32 rate on
Hopper. Evidence: matmul kernels without a tensor-core signature (names: sgemm, simt,
f32f32_f32f32...), with the ops that launched them. Fix priced: each such kernel runs at the
same share of the TF32 peak as it reached of the FP32 peak (device datasheet ratio).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.kernels import is_matmul_kernel, is_tensor_core_kernel
from aiprof.diagnosis.causes.common import ms
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.hardware import device
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "MATMUL_OFF_TENSOR_CORES"


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    k = f.rt.kernels
    if not g.n_ops or not len(k):
        return []
    names = k.strings("name")
    slow_label = np.array([is_matmul_kernel(s) and not is_tensor_core_kernel(s) for s in names.labels] + [False])
    kern = g.o_table == 0
    slow = np.zeros(g.n_ops, dtype=bool)
    slow[kern] = slow_label[names.codes[g.o_row[kern]]]
    if not slow.any():
        return []
    dev = device(f.rt.device_name)
    if dev is None:
        return []
    ratio = dev.fp32_tflops / dev.tf32_tflops
    e = f.edit(CODE)
    e.op_dur[slow] = g.o_dur[slow] * ratio
    per = max(len(f.steps), 1)
    slow_ns = float(g.o_dur[slow].sum())
    top = max(set(names.codes[g.o_row[slow]].tolist()), key=lambda c: g.o_dur[slow][names.codes[g.o_row[slow]] == c].sum())
    ops = [o["op"] for o in f.kernels.fp32_matmul_ops[:3]]
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(slow_ns / per)} per step of matrix products run in fp32 on the CUDA cores "
               f"({int(slow.sum() / per)} kernels per step, e.g. {names.labels[top][:60]})"),
        mechanism=(f"fp32 matmuls with TF32 disabled run at the CUDA cores' {dev.fp32_tflops:.0f} TFLOP/s instead of the "
                   f"tensor cores' {dev.tf32_tflops:.0f} (TF32) on {dev.name}."),
        remedy=("Allow TF32 tensor cores for fp32 matmuls: torch.backends.cuda.matmul.allow_tf32 = True (or "
                "torch.set_float32_matmul_precision('high')); better still, run the model under "
                "torch.autocast(device_type='cuda', dtype=torch.bfloat16)."),
        place=Place("kernel", names.labels[top], "", [], []),
        evidence={"slow_matmul_us_per_step": slow_ns / per / 1e3, "kernels": int(slow.sum()),
                  "fp32_ops": ops, "speedup_assumed": 1 / ratio, "device": dev.name},
        edit=e, claims=[Claim(SLOW_KERNELS, f.rank, slow_ns / 1e3 * (1 - ratio))])]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "kernels", "rt", "steps"), detect=detect,
                    acts_on=("gpu: compute",))
