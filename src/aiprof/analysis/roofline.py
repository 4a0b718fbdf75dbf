"""A roofline per kernel family: the work each op call's kernels did (FLOPs and bytes from the
op's recorded input shapes and dtypes) against the GPU time they took and the device's peaks;
each family placed on the compute or memory side of the ridge, and called latency-bound when it
reaches neither roof. Definitions and sources in docs/metrics.md ("Roofline").

Needs ``--what shapes`` (record_shapes). An op call whose inputs carry no dtype (tensor lists,
scalars only) is left out, and the share of kernel time that is covered is reported with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis.flops import ATTENTION_BACKWARD_FACTOR, estimate_flops
from aiprof.analysis.kernels import is_tensor_core_kernel, kernel_family
from aiprof.analysis.rankdiff import parse_dims
from aiprof.hardware import device as device_spec
from aiprof.trace.store import RankTrace

NS_PER_S = 1e9
# Bytes per element of the dtypes record_shapes writes ("Input type"); others leave the op out.
DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1,
               "c10::Float8_e5m2": 1, "c10::complex<float>": 8}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
# Ops whose first tensor input is their destination: written, not read.
DESTINATION_FIRST_OPS = ("aten::copy_", "aten::fill_", "aten::zero_")
# The fused attention ops that launch the kernels (the sdpa op above them launches none), and the
# layout of their q/k inputs: flash and memory-efficient take [B, L, H, E], cuDNN [B, H, L, E].
ATTENTION_LAYOUT_BLHE = ("aten::_flash_attention", "aten::_efficient_attention")
ATTENTION_LAYOUT_BHLE = ("aten::_cudnn_attention", "aten::_scaled_dot_product")
# Ops whose output is much smaller than their input (a reduction): their write is not counted.
REDUCTION_WORDS = ("sum", "mean", "amax", "amin", "max", "min", "norm", "var", "std", "argmax", "argmin", "nll_loss")
# A family reaching less than this share of the roof above its intensity is latency-bound: its
# kernels are too short or too narrow to load either the memory system or the math pipes (on an
# H100 a 5 µs elementwise kernel over 1 MB reaches ~6% of HBM bandwidth).
LATENCY_ROOF_SHARE = 0.2
# Families below this share of the covered kernel time are not listed.
MIN_FAMILY_SHARE = 0.005
NO_SHAPES = "no op carries input shapes and dtypes: add --what shapes"
NO_KERNELS = "no GPU kernels"
NO_DEVICE = "no peaks known for this GPU (docs/metrics.md lists them)"


@dataclass
class RooflineFamily:
    family: str
    ops: list[str]  # the ops whose calls launched it, most time first
    calls: int  # op calls
    gpu_us: float
    flops: float
    bytes: float
    intensity: float  # FLOPs per byte
    tflops_per_s: float
    gbps: float
    roof_tflops_per_s: float  # min(compute peak, intensity x memory peak)
    roof_pct: float  # achieved / roof
    side: str  # "compute" or "memory": which roof is the lower at this intensity
    bound: str  # "compute-bound", "memory-bound", "latency-bound"
    compute_peak: str  # which compute peak: "bf16 tensor cores", "tf32 tensor cores", "fp32 CUDA cores"


@dataclass
class Roofline:
    device: str
    dram_gbps: float | None
    covered_pct: float  # share of compute kernel time whose op's work is known
    families: list[RooflineFamily] = field(default_factory=list)
    reason: str | None = None  # why there is no roofline (None: there is one)


def _numel(d: object) -> int | None:
    if not isinstance(d, list) or not all(isinstance(x, int) for x in d):
        return None
    n = 1
    for x in d:
        n *= x
    return n


def op_work(name: str, dims: str, types: str) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one op call from its input shapes and dtypes, or None when unknown.

    Bytes: every tensor input read once, plus the output written once: M x N (x B) for a matmul,
    the largest input for any other op (elementwise), nothing for a reduction. FLOPs: the matmul
    and attention formulas of analysis.flops, else one per element of the largest input.
    """
    ds, ts = parse_dims(dims), parse_dims(types)
    read, largest, item = 0.0, 0, 0
    for i, (d, t) in enumerate(zip(ds, ts)):
        n, b = _numel(d), DTYPE_BYTES.get(t) if isinstance(t, str) else None
        if n is None or b is None or not d:
            continue
        if n > largest:
            largest, item = n, b
        if not (i == 0 and name in DESTINATION_FIRST_OPS):
            read += n * b
    if not largest:
        return None
    attention = "attention" in name and name.startswith(ATTENTION_LAYOUT_BLHE + ATTENTION_LAYOUT_BHLE)
    if name in MATMUL_OPS or attention:
        flops = _attention_flops(name, ds) if attention else estimate_flops(name, dims)
        if not flops:
            return None
        try:
            if attention:
                write = 0.0 if name.endswith("_backward") else _numel(ds[0]) * item  # the output is q-shaped
            else:
                a, b = (ds[1], ds[2]) if name in ("aten::addmm", "aten::baddbmm") else (ds[0], ds[1])
                write = _numel(a[:-1] + b[-1:]) * item
        except (IndexError, TypeError):
            return None
        return flops, read + write
    short = name.removeprefix("aten::").strip("_")
    write = 0.0 if any(short.startswith(w) or short.endswith(w) for w in REDUCTION_WORDS) else largest * item
    return float(largest), read + write


def _attention_flops(name: str, ds: list) -> float:
    """QK^T and PV of a fused attention op (model FLOPs, as analysis.flops counts them)."""
    try:
        q, k = ds[0], ds[1]
        if name.startswith(ATTENTION_LAYOUT_BLHE):
            b, lq, h, e = q[-4], q[-3], q[-2], q[-1]
            lk = k[-3]
        else:
            b, h, lq, e = q[-4], q[-3], q[-2], q[-1]
            lk = k[-2]
        fwd = 4.0 * b * h * lq * lk * e
    except (IndexError, TypeError):
        return 0.0
    return fwd * ATTENTION_BACKWARD_FACTOR if name.endswith("_backward") else fwd


def _compute_peak(dev, kernel: str, types: str) -> tuple[float, str]:
    """The compute roof of an op's kernel in TFLOP/s, and what it is."""
    first = (parse_dims(types) or [""])[0]
    if is_tensor_core_kernel(kernel):
        if first in ("c10::BFloat16", "c10::Half"):
            return dev.bf16_tflops, "bf16 tensor cores"
        return dev.tf32_tflops, "tf32 tensor cores"
    return dev.fp32_tflops, "fp32 CUDA cores"


def roofline(rt: RankTrace) -> Roofline:
    """The rank's roofline by kernel family (see the module docstring)."""
    name = rt.device_name
    dev = device_spec(name)
    k, o = rt.kernels, rt.ops
    if not len(k):
        return Roofline(name, None, 0.0, reason=NO_KERNELS)
    if dev is None or not dev.dram_gbps:
        return Roofline(name, None, 0.0, reason=NO_DEVICE)
    if not len(o) or "input_dims" not in o or "input_types" not in o:
        return Roofline(name, dev.dram_gbps, 0.0, reason=NO_SHAPES)
    comm = k.strings("cls").isin_labels(lambda s: s == "communication")
    kn = k.strings("name")
    kext, kdur = k["ext_id"], k["dur"].astype(np.float64)
    compute_ns = float(kdur[~comm].sum())
    # each op call's kernels (by External id): their summed time and the longest one's name
    oext = o["ext_id"]
    order = np.argsort(oext, kind="stable")
    se = oext[order]
    pos = np.clip(np.searchsorted(se, kext), 0, max(len(se) - 1, 0))
    hit = (se[pos] == kext) & (kext >= 0) & ~comm
    rows, d, codes = order[pos][hit], kdur[hit], kn.codes[hit]
    call_rows, inv = npx.unique(rows, return_inverse=True)
    call_ns = np.bincount(inv, weights=d, minlength=len(call_rows))
    by_len = np.lexsort((d, inv))  # per call, its kernels shortest first: the last is the longest
    last = np.r_[np.nonzero(np.diff(inv[by_len]))[0], len(by_len) - 1] if len(by_len) else by_len
    call_kernel = codes[by_len[last]]
    names, dims, types = o.strings("name"), o.strings("input_dims"), o.strings("input_types")
    work_cache: dict[tuple[int, int, int], tuple[float, float] | None] = {}
    family_of: dict[int, str] = {}  # by kernel name code: a few names recur over many calls
    fam: dict[str, dict] = {}
    covered = 0.0
    # each call's (name, dims, types) codes as tuples of ints: no numpy scalar per call
    call_keys = zip(names.codes[call_rows].tolist(), dims.codes[call_rows].tolist(), types.codes[call_rows].tolist())
    for key, ns, kc in zip(call_keys, call_ns.tolist(), call_kernel.tolist()):
        if key not in work_cache:
            work_cache[key] = op_work(names.labels[key[0]], dims.labels[key[1]], types.labels[key[2]])
        w = work_cache[key]
        if w is None:
            continue
        covered += ns
        family = family_of.get(kc)
        if family is None:
            family = family_of[kc] = kernel_family(kn.labels[kc])
        f = fam.get(family)
        if f is None:  # the family's compute roof: its first call's kernel and dtype
            f = fam[family] = {"calls": 0, "ns": 0.0, "flops": 0.0, "bytes": 0.0, "ops": {},
                               "peak": _compute_peak(dev, kn.labels[kc], types.labels[key[2]])}
        f["calls"] += 1
        f["ns"] += ns
        f["flops"] += w[0]
        f["bytes"] += w[1]
        op = names.labels[key[0]]
        f["ops"][op] = f["ops"].get(op, 0.0) + ns
    if not covered:
        return Roofline(name, dev.dram_gbps, 0.0, reason=NO_SHAPES)
    out = []
    for family, f in sorted(fam.items(), key=lambda kv: -kv[1]["ns"]):
        if f["ns"] < MIN_FAMILY_SHARE * covered:
            continue
        peak_tf, peak_what = f["peak"]
        sec = f["ns"] / NS_PER_S
        intensity = f["flops"] / f["bytes"]
        mem_roof_tf = intensity * dev.dram_gbps * 1e9 / 1e12
        roof = min(peak_tf, mem_roof_tf)
        tflops = f["flops"] / sec / 1e12
        side = "compute" if peak_tf <= mem_roof_tf else "memory"
        share = tflops / roof if roof else 0.0
        bound = "latency-bound" if share < LATENCY_ROOF_SHARE else f"{side}-bound"
        out.append(RooflineFamily(family, [op for op, _ in sorted(f["ops"].items(), key=lambda kv: -kv[1])][:3],
                                  f["calls"], f["ns"] / 1e3, f["flops"], f["bytes"], intensity, tflops,
                                  f["bytes"] / sec / 1e9, roof, 100.0 * share, side, bound, peak_what))
    return Roofline(name, dev.dram_gbps, 100.0 * covered / compute_ns if compute_ns else 0.0, out)
