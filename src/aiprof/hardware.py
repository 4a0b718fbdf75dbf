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
    dram_gbps: float = 0.0  # HBM bandwidth, datasheet (GB/s)
    nvlink_gbps_per_dir: float = 0.0  # NVLink bandwidth per direction per GPU, datasheet (GB/s)
    sms: int = 0  # streaming multiprocessors (when the trace's deviceProperties lack numSms)


# H100/H200 SXM: NVIDIA H100/H200 datasheets (FP32 67, TF32 495 and BF16 989 TFLOPS dense).
# Pinned H2D: 54.1 GB/s measured on the lent H100 (PCIe Gen5 x16; bench/diagnosis/gpu_pairs.py
# calibration). NVLink 4: 900 GB/s per GPU both ways, NCCL all-reduce reaches ~360+ GB/s busbw.
_HOPPER = dict(fp32_tflops=67.0, tf32_tflops=494.7, bf16_tflops=989.4, pinned_h2d_gbps=54.0, nvlink_busbw_gbps=360.0)
# A100 SXM: datasheet FP32 19.5, TF32 156, BF16 312; PCIe Gen4 x16 pinned copies ~25 GB/s.
_A100 = dict(fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, pinned_h2d_gbps=25.0, nvlink_busbw_gbps=230.0)
# HBM: H100 SXM 3.35 TB/s, H200 4.8 TB/s, GH200 (96 GB HBM3) 4.0 TB/s, A100 80GB SXM 2.04 TB/s
# (datasheets). NVLink per direction: NVLink 4 is 18 links x 25 GB/s = 450 GB/s (Hopper),
# NVLink 3 12 x 25 = 300 GB/s (A100). SMs: 132 on the H100/H200/GH200 SXM parts (the lent H100
# reports numSms 132; the PCIe H100 has 114, so the trace's own numSms always wins), 108 on the A100.
DEVICES = (("H200", {**_HOPPER, "dram_gbps": 4800.0, "nvlink_gbps_per_dir": 450.0, "sms": 132}),
           ("H100", {**_HOPPER, "dram_gbps": 3350.0, "nvlink_gbps_per_dir": 450.0, "sms": 132}),
           ("GH200", {**_HOPPER, "dram_gbps": 4000.0, "nvlink_gbps_per_dir": 450.0, "sms": 132}),
           ("A100", {**_A100, "dram_gbps": 2039.0, "nvlink_gbps_per_dir": 300.0, "sms": 108}))


def device(name: str) -> Device | None:
    """The table entry for a device name as CUDA reports it ('NVIDIA H100 80GB HBM3'), or None."""
    for key, spec in DEVICES:
        if key in name:
            return Device(name=key, **spec)
    return None
