"""GPU kernel statistics per kernel name. Definitions in docs/metrics.md ("Kernels")."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.memo import analysis_cache
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0


@dataclass
class KernelStat:
    name: str
    cls: str  # compute | communication
    calls: int
    total_us: float
    mean_us: float
    median_us: float
    p95_us: float
    share_pct: float  # of the summed duration of all kernels of the rank


def kernel_stats(rt: RankTrace, top: int | None = None) -> list[KernelStat]:
    """Per kernel name: calls and time statistics, sorted by total time (descending)."""
    k = rt.kernels
    if not len(k):
        return []
    names = k.strings("name")
    cls = k.strings("cls")
    codes, dur = names.codes, k["dur"]
    total_all = float(dur.sum()) or 1.0
    totals = np.bincount(codes, weights=dur, minlength=len(names.labels))
    counts = np.bincount(codes, minlength=len(names.labels))
    order = np.argsort(-totals, kind="stable")
    if top is not None:
        order = order[:top]
    by_code = np.argsort(codes, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    cls_of = np.zeros(len(names.labels), dtype=np.int32)
    cls_of[codes] = cls.codes
    out = []
    for c in order:
        if counts[c] == 0:
            continue
        d = dur[by_code[bounds[c]:bounds[c + 1]]]
        out.append(KernelStat(
            name=names.labels[c], cls=cls.labels[cls_of[c]], calls=int(counts[c]),
            total_us=float(totals[c]) / NS_PER_US, mean_us=float(d.mean()) / NS_PER_US,
            median_us=float(np.median(d)) / NS_PER_US, p95_us=float(np.percentile(d, 95)) / NS_PER_US,
            share_pct=100.0 * float(totals[c]) / total_all,
        ))
    return out


def top_with_other(stats: list[KernelStat], k: int, by: str = "total_us") -> dict:
    """The ``k`` kernels with the most ``by`` (``total_us`` or ``calls``) and one bucket for all
    the others: ``{"by", "top": [KernelStat...], "other": {"kernels", "calls", "total_us"}}``, so a
    top-k chart still adds up to every kernel of the rank."""
    if by not in ("total_us", "calls"):
        raise ValueError(f"by must be total_us or calls, not {by!r}")
    order = sorted(stats, key=lambda s: (-getattr(s, by), -s.total_us, s.name))
    top, rest = order[:max(k, 0)], order[max(k, 0):]
    return {"by": by, "top": top, "other": {"kernels": len(rest), "calls": int(sum(s.calls for s in rest)),
                                           "total_us": float(sum(s.total_us for s in rest))}}


# ---------------------------------------------------------------- families, tensor cores, precision
# A kernel name is a matmul/conv (tensor-core candidate) when it contains one of these.
_MATMUL_WORDS = ("gemm", "gemv", "matmul", "cutlass", "cublas", "nvjet", "wgmma", "xmma", "hmma",
                 "convolution", "convolve", "conv2d", "conv3d", "conv1d", "_conv_", "sdpa", "flash",
                 "fmha", "attention", "dgrad", "wgrad", "mma_")
# ...but not these (cuDNN helper kernels whose names contain the words above)
_NOT_MATMUL_WORDS = ("convert_", "dq_to_")
# Tensor-core signatures in cuBLAS/cuDNN/CUTLASS/Triton kernel names (SM70+).
_TENSOR_CORE_WORDS = ("tensorop", "wgmma", "hmma", "imma", "xmma", "mma_", "s16816", "h16816",
                      "s1688", "h1688", "i8816", "nvjet", "sm90_", "sm80_", "sm100_", "tf32",
                      "flash", "fmha", "bf16", "fp16", "f16", "e4m3", "e5m2", "fp8", "int8")
_NON_TC_WORDS = ("sgemm", "gemv", "gemmsn", "dot_kernel", "gemvx", "gemv2", "simt", "f32f32_f32f32")
# precision tokens, most specific first (a name says bf16 and also contains f16)
_PRECISION_TOKENS = (("fp8", ("e4m3", "e5m2", "fp8", "f8")), ("int8", ("int8", "i8816", "imma", "s8")),
                     ("bf16", ("bf16", "bfloat16")), ("tf32", ("tf32",)),
                     ("fp16", ("fp16", "f16", "half", "h16816", "h1688", "hgemm", "hmma")),
                     ("fp32", ("sgemm", "fp32", "f32", "float")))
_DTYPE_PRECISION = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64",
                    "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8", "signed char": "int8",
                    "c10::qint8": "int8", "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8"}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
              "aten::convolution", "aten::cudnn_convolution", "aten::_convolution", "aten::addbmm",
              "aten::_scaled_dot_product", "aten::linear", "aten::matmul", "aten::conv")


def kernel_family(name: str) -> str:
    """A kernel's family: its name without template arguments and parameters."""
    n = name.removeprefix("void ")
    n = n.replace("(anonymous namespace)::", "")
    cut = len(n)
    for ch in "<(":
        i = n.find(ch)
        if 0 < i < cut:
            cut = i
    fam = n[:cut].strip()
    # cuBLAS/cutlass names carry the tile shape; keep the library and precision part
    if fam.startswith("cutlass::Kernel") and "<" in n:
        inner = n[n.find("<") + 1:].split("_")
        fam = "cutlass " + "_".join(inner[:3])
    elif fam.startswith("nvjet_"):
        fam = "nvjet (cuBLAS)"
    elif fam.startswith(("cudnn_generated", "sm90_xmma", "sm80_xmma")):
        fam = fam.split("_kernel")[0]
    return fam


def is_matmul_kernel(name: str) -> bool:
    """True for matmul, convolution and attention kernels (by name)."""
    n = name.lower()
    return any(w in n for w in _MATMUL_WORDS) and not any(w in n for w in _NOT_MATMUL_WORDS)


def is_tensor_core_kernel(name: str) -> bool:
    """Matmul/conv kernel that uses tensor cores, judged from its name (see docs/metrics.md)."""
    n = name.lower()
    if not is_matmul_kernel(n):
        return False
    if any(w in n for w in _NON_TC_WORDS) and "tf32" not in n:
        return False
    return any(w in n for w in _TENSOR_CORE_WORDS)


def kernel_precision(name: str) -> str:
    """Precision of a matmul kernel from its name ("" when the name does not say)."""
    n = name.lower()
    for prec, toks in _PRECISION_TOKENS:
        if any(t in n for t in toks):
            return prec
    return ""


# ------------------------------------------------------------- precision of every kernel
# cuBLAS nvjet names carry the A/compute/output types as letters after "nvjet_[smNN_]": "t" is
# bf16 (every nvjet_*_tst_* kernel of the H100/H200 traces ran under an aten::mm on BFloat16
# inputs), "h"/"s"/"d" fp16/fp32/fp64 as in BLAS names.
_NVJET_TYPES = re.compile(r"^nvjet_(?:sm\d+_)?([a-z])[a-z]{2}_")
_NVJET_PRECISION = {"t": "bf16", "h": "fp16", "s": "fp32", "d": "fp64"}
# C++ element types in template arguments; the first one named is the kernel's data type
# (BinaryFunctor<c10::BFloat16, ..., MulFunctor<float>> works on bf16, float is its math type).
# Integer types are not used: in kernel names they are mostly index types
# (CatArrayBatchedCopy<OpaqueType<2u>, unsigned int, ...>).
_CPP_TYPES = (("fp8", re.compile(r"Float8_e[45]m[23]|__nv_fp8")),
              ("bf16", re.compile(r"BFloat16|__nv_bfloat16|bfloat16_t")),
              ("fp16", re.compile(r"c10::Half\b|\b__half\b|\bhalf_t\b")),
              ("fp64", re.compile(r"\bdouble\b")),
              ("fp32", re.compile(r"\bfloat\b")))
# Precisions only a kernel's name can tell (the op's inputs say fp32 for a TF32 matmul); for the
# others the op's input dtype wins: 16-bit tensor-core names say "f16"/"h16816" for bf16 too
# (cuDNN's sdpa ..._wgmma_f16_... kernels run under bf16 attention ops).
_NAME_ONLY_PRECISIONS = ("tf32", "fp8", "int8")
# whole-word dtype names, e.g. NCCL's ncclDevKernel_AllReduce_Sum_bf16_RING_LL
_DTYPE_WORDS = (("fp8", {"fp8", "e4m3", "e5m2"}), ("int8", {"int8", "i8", "u8"}), ("bf16", {"bf16", "bfloat16"}),
                ("fp16", {"fp16", "f16", "half"}), ("tf32", {"tf32"}), ("fp32", {"fp32", "f32", "float"}),
                ("fp64", {"fp64", "f64", "double"}))
# an op input that is an integer or boolean tensor (indices, masks): the data is not floating point
_INT_DTYPES = {"long int", "int", "short int", "unsigned char", "bool", "long", "unsigned int", "uint8_t",
               "int64_t", "int32_t"}
INT_PRECISION = "int"  # integer or boolean data
UNKNOWN_PRECISION = "unknown"


def _without_params(name: str) -> str:
    """A kernel's name without its return type and parameter list (their types are arguments)."""
    n = name.replace("(anonymous namespace)", "")
    depth = 0
    for i, ch in enumerate(n):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            return n[:i]
    return n


def name_precision(name: str) -> str:
    """The precision a kernel's name states ("" when it does not): library tokens of a matmul
    kernel (:func:`kernel_precision`), else cuBLAS nvjet type letters, else the C++ element types of
    its template arguments, else a dtype word (NCCL kernels)."""
    if is_matmul_kernel(name):
        p = kernel_precision(name)
        if p:
            return p
        m = _NVJET_TYPES.match(name)
        if m:
            return _NVJET_PRECISION.get(m.group(1), "")
    head = _without_params(name)
    first = min(((m.start(), prec) for prec, rx in _CPP_TYPES for m in [rx.search(head)] if m), default=None)
    if first is not None:
        return first[1]
    words = set(re.split(r"[^0-9a-z]+", head.lower().replace("_", " ")))
    for prec, ws in _DTYPE_WORDS:
        if words & ws:
            return prec
    return ""


def op_input_precision(input_types: str) -> str:
    """Precision of an op from its ``Input type`` list (``record_shapes``): the first floating
    point input; ``int`` when every tensor input is integer or boolean; "" when unknown."""
    try:
        raw = json.loads(input_types) if input_types else []
    except ValueError:
        raw = []
    types = [str(t) for t in raw] if isinstance(raw, list) else []  # null or a number: no types
    floats = [_DTYPE_PRECISION[t] for t in types if t in _DTYPE_PRECISION and _DTYPE_PRECISION[t] != "int8"]
    if floats:
        return floats[0]
    if any(t in _DTYPE_PRECISION or t in _INT_DTYPES for t in types):
        return "int8" if any(_DTYPE_PRECISION.get(t) == "int8" for t in types) else INT_PRECISION
    return ""


# ATen's type-erased copies (cat, index) name only the element size: OpaqueType<2u> is a 16-bit
# element, fp16 or bf16; it gets the 16-bit type the rank's other kernels use most (by time).
_OPAQUE_16BIT = re.compile(r"OpaqueType<2u?>")
PRECISION_FROM_NAME, PRECISION_FROM_OP, PRECISION_UNKNOWN = 0, 1, -1


def kernel_precisions(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel row: its precision ("" unknown) and where it was read.

    The launching op is the op whose External id the kernel carries (the innermost op around its
    launch); its precision is that of its first floating point input (``record_shapes``). A
    kernel gets tf32/fp8/int8 when its name says so (only the name can), else its op's floating
    point precision, else the precision its name states, else ``int`` when its op has only
    integer/boolean inputs. Sources: PRECISION_FROM_NAME, PRECISION_FROM_OP, PRECISION_UNKNOWN.
    Cached on the rank."""
    cache = analysis_cache(rt)
    if "kernel_precisions" in cache:
        return cache["kernel_precisions"]
    k, o = rt.kernels, rt.ops
    if not len(k):
        out = (np.zeros(0, dtype=object), np.zeros(0, dtype=np.int8))
        cache["kernel_precisions"] = out
        return out
    names = k.strings("name")
    by_name = np.array([name_precision(s) for s in names.labels] + [""], dtype=object)[names.codes]
    by_op = np.full(len(k), "", dtype=object)
    if len(o) and "input_types" in o and "ext_id" in o:
        oe = o["ext_id"]
        order = np.argsort(oe, kind="stable")
        se = oe[order]
        ke = k["ext_id"]
        pos = np.clip(np.searchsorted(se, ke), 0, len(se) - 1)
        hit = (se[pos] == ke) & (ke >= 0)
        it = o.strings("input_types")
        op_prec = np.array([op_input_precision(s) for s in it.labels] + [""], dtype=object)
        by_op = np.where(hit, op_prec[it.codes[order[pos]]], "")
    name_only = np.isin(by_name, _NAME_ONLY_PRECISIONS)
    op_float = (by_op != "") & (by_op != INT_PRECISION) & ~name_only
    use_name = ~op_float & (by_name != "")
    use_op = op_float | (~use_name & (by_op != ""))
    prec = np.where(use_op, by_op, np.where(use_name, by_name, ""))
    src = np.where(use_op, PRECISION_FROM_OP, np.where(use_name, PRECISION_FROM_NAME, PRECISION_UNKNOWN)).astype(np.int8)
    opaque = (prec == "") & _per_label(names, _OPAQUE_16BIT.search)[names.codes]
    if opaque.any():
        dur = k["dur"]
        half = {p: float(dur[prec == p].sum()) for p in ("bf16", "fp16")}
        if max(half.values()) > 0:
            prec[opaque] = max(half, key=half.get)
            src[opaque] = PRECISION_FROM_NAME
    cache["kernel_precisions"] = (prec, src)
    return prec, src


def _time_by(labels: np.ndarray, dur_ns: np.ndarray, sel: np.ndarray | None = None) -> dict:
    """Summed duration (µs) per label, largest first; "" is reported as ``unknown``."""
    if sel is not None:
        labels, dur_ns = labels[sel], dur_ns[sel]
    out: dict[str, float] = {}
    for lab in sorted(set(labels.tolist())):
        out[lab or UNKNOWN_PRECISION] = float(dur_ns[labels == lab].sum()) / NS_PER_US
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass
class OpKernels:
    """GPU time grouped by the torch op that launched it."""

    op: str
    kernels: int
    gpu_us: float
    share_pct: float


@dataclass
class KernelAnalysis:
    """Kernel-level facts of one rank (see docs/metrics.md, "Kernels")."""

    gpu_time_us: float  # summed kernel durations
    compute_us: float
    communication_us: float
    matmul_us: float
    tensor_core_us: float
    tensor_core_pct_of_compute: float
    non_tc_matmul_us: float
    non_tc_matmul_kernels: list[str]  # names of matmul kernels without tensor cores, by time
    precision_us: dict  # matmul kernel time by precision (kernel name, else the launching op's input dtype)
    kernel_precision_us: dict  # all kernel time by precision, same sources ("unknown" where neither says)
    kernel_precision_source_us: dict  # all kernel time by where its precision was read: name, op dtype, unknown
    op_precision: dict  # matmul op calls by input dtype: {"bf16": calls, ...}
    fp32_matmul_ops: list[dict]  # [{"op","calls","gpu_us"}] matmul ops with fp32 inputs
    families: list[dict]  # [{"family","calls","total_us","share_pct_of_compute"}]
    by_op: list[OpKernels]
    launches_per_step: float
    mean_kernel_us: float
    median_kernel_us: float


def _per_label(s, pred) -> np.ndarray:
    return np.array([bool(pred(x)) for x in s.labels] + [False], dtype=bool)


def kernel_analysis(rt: RankTrace, n_steps: int = 1, top: int = 15) -> KernelAnalysis:
    """Tensor-core share, precision mix, families, per-op grouping, launch counts."""
    k = rt.kernels
    if not len(k):
        return KernelAnalysis(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, [], {}, {}, {}, _op_precision(rt), [], [], [], 0.0, 0.0,
                              0.0)
    names = k.strings("name")
    dur = k["dur"].astype(np.float64)
    comm = k.strings("cls").isin_labels(lambda s: s == "communication")
    mm = _per_label(names, is_matmul_kernel)[names.codes] & ~comm
    tc = _per_label(names, is_tensor_core_kernel)[names.codes] & ~comm
    compute_ns = float(dur[~comm].sum())
    prec, prec_src = kernel_precisions(rt)
    source_label = np.array(["", "name", "op dtype"], dtype=object)[prec_src + 1]
    nontc = mm & ~tc
    per_name = np.bincount(names.codes[nontc], weights=dur[nontc], minlength=len(names.labels))
    nontc_names = [names.labels[c] for c in np.argsort(-per_name)[:5] if per_name[c] > 0]
    # families over compute kernels
    fam_labels = [kernel_family(s) for s in names.labels]
    fam_index: dict[str, int] = {}
    fam_of = np.array([fam_index.setdefault(f, len(fam_index)) for f in fam_labels] + [0], dtype=np.int64)
    fcodes = fam_of[names.codes]
    ftot = np.bincount(fcodes[~comm], weights=dur[~comm], minlength=len(fam_index))
    fcnt = np.bincount(fcodes[~comm], minlength=len(fam_index))
    fam_names = list(fam_index)
    families = [{"family": fam_names[f], "calls": int(fcnt[f]), "total_us": float(ftot[f]) / NS_PER_US,
                 "share_pct_of_compute": 100.0 * float(ftot[f]) / compute_ns if compute_ns else 0.0}
                for f in np.argsort(-ftot)[:top] if fcnt[f]]
    return KernelAnalysis(
        gpu_time_us=float(dur.sum()) / NS_PER_US, compute_us=compute_ns / NS_PER_US,
        communication_us=float(dur[comm].sum()) / NS_PER_US, matmul_us=float(dur[mm].sum()) / NS_PER_US,
        tensor_core_us=float(dur[tc].sum()) / NS_PER_US,
        tensor_core_pct_of_compute=100.0 * float(dur[tc].sum()) / compute_ns if compute_ns else 0.0,
        non_tc_matmul_us=float(dur[nontc].sum()) / NS_PER_US, non_tc_matmul_kernels=nontc_names,
        precision_us=_time_by(prec, dur, mm), kernel_precision_us=_time_by(prec, dur),
        kernel_precision_source_us=_time_by(source_label, dur), op_precision=_op_precision(rt), fp32_matmul_ops=_fp32_matmul_ops(rt),
        families=families, by_op=kernels_by_op(rt, top),
        launches_per_step=len(k) / max(n_steps, 1),
        mean_kernel_us=float(dur.mean()) / NS_PER_US, median_kernel_us=float(np.median(dur)) / NS_PER_US,
    )


def _matmul_op_mask(rt: RankTrace) -> np.ndarray:
    o = rt.ops
    return o.strings("name").isin_labels(lambda s: s.startswith(MATMUL_OPS) and not s.endswith("_backward")
                                        or s.startswith("aten::_scaled_dot_product"))


def _first_dtype(types: str) -> str:
    t = types.strip("[]").split(",")[0].strip().strip('"')
    return _DTYPE_PRECISION.get(t, t or "unknown")


def _op_precision(rt: RankTrace) -> dict:
    """Calls of leaf matmul ops (mm, addmm, bmm, conv, attention) by first input dtype."""
    o = rt.ops
    if not len(o) or "input_types" not in o:
        return {}
    leaf = o.strings("name").isin_labels(lambda s: s in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                                                        "aten::_scaled_mm", "aten::cudnn_convolution",
                                                        "aten::convolution")
                                        or s.startswith("aten::_scaled_dot_product"))
    # under autocast the fp32 op is a wrapper around the bf16/fp16 op that launches the kernel:
    # count only ops that launched GPU work (when the trace has GPU work at all)
    launched = _launched_gpu_ns(rt)
    if launched is not None:
        leaf &= launched > 0
    it = o.strings("input_types")
    prec_of = np.array([_first_dtype(s) for s in it.labels] + [""], dtype=object)
    p = prec_of[it.codes[leaf]]
    vals, cnt = np.unique(p.astype(str), return_counts=True)
    return {str(v): int(c) for v, c in zip(vals, cnt)}


def _fp32_matmul_ops(rt: RankTrace) -> list[dict]:
    """Leaf matmul ops whose first input is fp32, with the GPU time of their kernels."""
    o = rt.ops
    if not len(o) or "input_types" not in o:
        return []
    names = o.strings("name")
    leaf = names.isin_labels(lambda s: s in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"))
    it = o.strings("input_types")
    fp32 = _per_label(it, lambda s: _first_dtype(s) == "fp32")[it.codes] & leaf
    if not fp32.any():
        return []
    g = _launched_gpu_ns(rt)
    if g is None:
        g = np.zeros(len(o))
    else:
        fp32 &= g > 0  # autocast wrappers launch nothing themselves
    cnt = np.bincount(names.codes[fp32], minlength=len(names.labels))
    tot = np.bincount(names.codes[fp32], weights=g[fp32], minlength=len(names.labels))
    return [{"op": names.labels[c], "calls": int(cnt[c]), "gpu_us": float(tot[c]) / NS_PER_US}
            for c in np.argsort(-tot) if cnt[c]]


def _launched_gpu_ns(rt: RankTrace) -> np.ndarray | None:
    """Per op row: summed duration of the kernels carrying its External id (None: no kernels)."""
    k, o = rt.kernels, rt.ops
    if not len(k):
        return None
    ext = k["ext_id"]
    ok = ext >= 0
    keys, inv = npx.unique(ext[ok], return_inverse=True)
    vals = np.bincount(inv, weights=k["dur"][ok])
    if not len(keys):
        return np.zeros(len(o))
    oe = o["ext_id"]
    pos = np.clip(np.searchsorted(keys, oe), 0, len(keys) - 1)
    return np.where(keys[pos] == oe, vals[pos], 0.0)


def kernels_by_op(rt: RankTrace, top: int = 15) -> list[OpKernels]:
    """Kernel time grouped by the op whose External id the kernel carries."""
    k, o = rt.kernels, rt.ops
    if not len(k) or not len(o):
        return []
    oext = o["ext_id"]
    order = np.argsort(oext, kind="stable")
    se = oext[order]
    kext = k["ext_id"]
    pos = np.clip(np.searchsorted(se, kext), 0, len(se) - 1)
    hit = (se[pos] == kext) & (kext >= 0)
    names = o.strings("name")
    code = np.where(hit, names.codes[order[pos]], len(names.labels))
    labels = names.labels + ["(no op)"]
    tot = np.bincount(code, weights=k["dur"], minlength=len(labels))
    cnt = np.bincount(code, minlength=len(labels))
    all_ns = float(k["dur"].sum()) or 1.0
    return [OpKernels(labels[c], int(cnt[c]), float(tot[c]) / NS_PER_US, 100.0 * float(tot[c]) / all_ns)
            for c in np.argsort(-tot)[:top] if cnt[c]]
