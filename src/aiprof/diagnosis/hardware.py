"""Per-device peak rates the what-if needs (vendor datasheets, dense, SXM parts) and copy
bandwidths measured on the lent machines. Matched by a substring of the device name."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    fp32_tflops: float  # CUDA cores
    tf32_tflops: float  # tensor cores, dense
    bf16_tflops: float  # tensor cores, dense
    pinned_h2d_gbps: float  # host-to-device copy from pinned memory, as achieved
    nvlink_busbw_gbps: float  # NCCL all-reduce bus bandwidth reachable intra-node (0: no NVLink)


# H100/H200 SXM: NVIDIA H100/H200 datasheets (FP32 67, TF32 495 and BF16 989 TFLOPS dense).
# Pinned H2D: 54.1 GB/s measured on the lent H100 (PCIe Gen5 x16; bench/diagnosis/gpu_pairs.py
# calibration). NVLink 4: 900 GB/s per GPU both ways, NCCL all-reduce reaches ~360+ GB/s busbw.
_HOPPER = dict(fp32_tflops=67.0, tf32_tflops=494.7, bf16_tflops=989.4, pinned_h2d_gbps=54.0, nvlink_busbw_gbps=360.0)
# A100 SXM: datasheet FP32 19.5, TF32 156, BF16 312; PCIe Gen4 x16 pinned copies ~25 GB/s.
_A100 = dict(fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, pinned_h2d_gbps=25.0, nvlink_busbw_gbps=230.0)
DEVICES = (("H200", _HOPPER), ("H100", _HOPPER), ("GH200", _HOPPER), ("A100", _A100))


def device(name: str) -> Device | None:
    """The table entry for a device name as CUDA reports it ('NVIDIA H100 80GB HBM3'), or None."""
    for key, spec in DEVICES:
        if key in name:
            return Device(name=key, **spec)
    return None
