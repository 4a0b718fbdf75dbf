"""FLOPs per op and per step, achieved TFLOP/s and MFU against the device's peak.
Definitions and the peak table's sources in docs/metrics.md ("Memory and FLOPs")."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.protocol import WHAT_LEVELS
from aiprof.trace.store import RankTrace

# Dense (no structured sparsity) peak TFLOP/s from NVIDIA's datasheets, per GPU model and
# precision. Matched against the device name in the trace, most specific first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "int8": 1513.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "int8": 733.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "int8": 242.5},
    "A10G": {"fp32": 31.2, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0, "int8": 140.0},
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0, "int8": 250.0},
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "fp16": 65.0, "int8": 130.0},
}
# Model-FLOP convention for attention backward: two matmuls forward, four backward.
ATTENTION_BACKWARD_FACTOR = 2.0
# Why a figure is unknown (the report shows "—" and this, never 0). FLOPs are estimated from the
# input shapes (protocol level "shapes": record_shapes) or read from torch's count ("flops").
_SHAPES, _FLOPS = "shapes", "flops"
assert _SHAPES in WHAT_LEVELS and _FLOPS in WHAT_LEVELS
NO_OPS = "no host ops recorded (FLOPs are counted on torch ops)"
NO_SHAPES = f"shapes not recorded: add --what {_SHAPES}"
NO_MATMULS = "no matmul or attention op in the steps (the only ops whose FLOPs are counted)"
NO_STEPS = "no steps"
CPU_ONLY = "CPU only: MFU is against a GPU's peak"
NO_PEAK = "no peak known for {device} at {precision} (docs/metrics.md lists the GPUs)"
_LEAF_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of ``device_name`` at ``precision``, or None when not in the table."""
    for model, peaks in PEAK_TFLOPS.items():
        if model in device_name:
            return peaks.get(precision)
    return None


def _dims(s: str) -> list:
    try:
        v = json.loads(s) if s else []
        return v if isinstance(v, list) else []
    except ValueError:
        return []


def estimate_flops(name: str, dims: str) -> float:
    """FLOPs of one call of a leaf matmul/attention op from its input shapes (0 when unknown)."""
    d = _dims(dims)
    try:
        if name in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = d[0], d[1]
            return 2.0 * m * k * n
        if name == "aten::addmm":
            (m, k), (_, n) = d[1], d[2]
            return 2.0 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = d[0], d[1]
            return 2.0 * b * m * k * n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = d[1], d[2]
            return 2.0 * b * m * k * n
        if name.startswith("aten::_scaled_dot_product") and "attention" in name:
            q, kk = d[0], d[1]
            b, h, lq, e = q[-4], q[-3], q[-2], q[-1]
            lk = kk[-2]
            fwd = 4.0 * b * h * lq * lk * e  # QK^T and PV
            return fwd * ATTENTION_BACKWARD_FACTOR if name.endswith("_backward") else fwd
    except (IndexError, TypeError, ValueError):
        return 0.0
    return 0.0


def _wrapper_rows(rt: RankTrace, leaf: np.ndarray) -> np.ndarray:
    """Op rows that wrap an op of the same name (autocast re-dispatches aten::addmm in fp32
    to aten::addmm in bf16): counting both would double the FLOPs."""
    from aiprof.analysis.hotspots import OP, host_tree

    tree = host_tree(rt)
    out = np.zeros(len(leaf), dtype=bool)
    if not len(tree):
        return out
    node_of_row = np.full(len(leaf), -1, dtype=np.int64)
    is_op = tree.kind == OP
    node_of_row[tree.row[is_op]] = np.nonzero(is_op)[0]
    nodes = node_of_row[np.nonzero(leaf)[0]]
    nodes = nodes[nodes >= 0]
    up = tree.nearest(tree.parent[nodes], OP)
    same = (up >= 0) & (tree.code[np.maximum(up, 0)] == tree.code[nodes])
    out[tree.row[up[same]]] = True
    return out


@dataclass
class FlopsAnalysis:
    source: str  # "trace" (with_flops), "shapes" (estimated from record_shapes), "none"
    total_flops: float | None  # None: unknown (flops_reason says why)
    by_op: list[dict]  # [{"op","calls","flops"}]
    per_step: list[dict]  # [{"step","flops","tflops_per_s","mfu_pct"}]; None where unknown
    precision: str
    peak_tflops: float | None
    device: str
    tflops_per_s: float | None = None  # median over the steps (None: no FLOPs)
    mfu_pct: float | None = None  # median over the steps (None: no FLOPs, or no peak for this GPU)
    flops_reason: str | None = None  # why the FLOPs are unknown (None: known)
    mfu_reason: str | None = None  # why the MFU is unknown (None: known)


def _mfu_reason(gpu: bool, device: str, precision: str, peak: float | None) -> str | None:
    if not gpu:
        return CPU_ONLY
    return NO_PEAK.format(device=device or "this GPU (model not recorded)", precision=precision) if not peak else None


def _unknown(why: str, steps, precision: str, peak: float | None, dev: str, gpu: bool) -> FlopsAnalysis:
    """FLOPs (and so MFU) unknown: null figures with the reason, never 0."""
    per = [{"step": int(n), "flops": None, "tflops_per_s": None, "mfu_pct": None} for n in steps.number] \
        if steps is not None and len(steps) else []
    return FlopsAnalysis("none", None, [], per, precision, peak, dev, flops_reason=why,
                         mfu_reason=why if gpu else CPU_ONLY)


def flops_analysis(rt: RankTrace, steps, precision: str = "bf16", gpu: bool = True) -> FlopsAnalysis:
    """FLOPs per op and per step; MFU = achieved / peak at ``precision`` on this device (``gpu``:
    the rank ran GPU work). What cannot be known is None with its reason, never 0."""
    o = rt.ops
    dev = rt.device_name
    peak = peak_tflops(dev, precision) if gpu else None
    if not len(o):
        return _unknown(NO_OPS, steps, precision, peak, dev, gpu)
    names = o.strings("name")
    f = o["flops"] if "flops" in o else np.full(len(o), np.nan)
    have = ~np.isnan(f)
    source = "trace"
    if not have.any():
        # estimate per distinct (name, dims) pair; ops repeat their shapes every step
        source = "shapes"
        leaf = names.isin_labels(lambda s: s in _LEAF_MATMULS or (s.startswith("aten::_scaled_dot_product")
                                                                  and "attention" in s))
        if "input_dims" not in o or not o.strings("input_dims").isin_labels(lambda s: s not in ("", "[]")).any():
            return _unknown(NO_SHAPES, steps, precision, peak, dev, gpu)
        if not leaf.any():
            return _unknown(NO_MATMULS, steps, precision, peak, dev, gpu)
        leaf &= ~_wrapper_rows(rt, leaf)
        dims = o.strings("input_dims")
        key = names.codes[leaf].astype(np.int64) * (len(dims.labels) + 1) + dims.codes[leaf]
        uk, inv = npx.unique(key, return_inverse=True)
        est = np.array([estimate_flops(names.labels[k // (len(dims.labels) + 1)],
                                       dims.labels[k % (len(dims.labels) + 1)]) for k in uk])
        f = np.zeros(len(o))
        f[leaf] = est[inv]
        have = f > 0
    f = np.where(have, f, 0.0)
    tot = np.bincount(names.codes, weights=f, minlength=len(names.labels))
    cnt = np.bincount(names.codes[have], minlength=len(names.labels))
    by_op = [{"op": names.labels[c], "calls": int(cnt[c]), "flops": float(tot[c])}
             for c in np.argsort(-tot)[:10] if tot[c] > 0]
    per_step = []
    if len(steps):
        idx = steps.index_of(o["ts"])
        ok = idx >= 0
        sf = np.bincount(idx[ok], weights=f[ok], minlength=len(steps))
        for i in range(len(steps)):
            dur_s = (steps.end[i] - steps.start[i]) / 1e9
            tf = sf[i] / dur_s / 1e12 if dur_s > 0 else 0.0
            per_step.append({"step": int(steps.number[i]), "flops": float(sf[i]), "tflops_per_s": float(tf),
                             "mfu_pct": 100.0 * tf / peak if peak else None})
    tf = [s["tflops_per_s"] for s in per_step if s["flops"] > 0]
    mfu = [s["mfu_pct"] for s in per_step if s["flops"] > 0 and s["mfu_pct"] is not None]
    return FlopsAnalysis(source, float(f.sum()), by_op, per_step, precision, peak, dev,
                         float(np.median(tf)) if tf else None, float(np.median(mfu)) if mfu else None,
                         mfu_reason=(_mfu_reason(gpu, dev, precision, peak) or NO_MATMULS) if not mfu else None)
