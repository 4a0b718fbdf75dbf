"""MISALIGNED_MATMUL: matrix products whose dimensions keep cuBLAS off its fast kernels.

Mechanism: cuBLAS's fast tensor-core kernels load their operands 16 bytes at a time, so each
matrix's leading dimension must be a multiple of 8 elements in fp16/bf16 (4 in fp32). When one
is not (a vocabulary of 50257 tokens, a hidden size of 1000), cuBLAS falls back to kernels that
load one or two elements at a time, on Hopper an older generation's mma instructions: the same
FLOPs at a fraction of the rate. PyTorch's Performance Tuning Guide: "use sizes that are
multiples of 8".

Evidence: matmul kernels whose name gives their operand alignment (CUTLASS's ``_alignN``) as
under 16 bytes, with the host op that launched them and, when shapes were recorded, the
dimension that is not a multiple of 8. Fix priced: each such op call's kernels replaced by one
kernel doing the op's FLOPs (its shapes) at the rate this rank's aligned tensor-core matmuls
reached (FLOPs over time of those calls, from the same trace).
"""
from __future__ import annotations

import re

import numpy as np

from aiprof.analysis.kernels import is_matmul_kernel, is_tensor_core_kernel
from aiprof.analysis.rankdiff import parse_dims
from aiprof.analysis.roofline import MATMUL_OPS, op_work
from aiprof.diagnosis.causes.common import drop_kernels, ms, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.kernel_ops import kernel_ops
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "MISALIGNED_MATMUL"
#: the operand load width of cuBLAS's fast kernels (one 128-bit load)
ALIGNED_BYTES = 16
#: CUTLASS names its kernels' operand alignment in elements: ..._align1, _align2, _align4, _align8
_ALIGN = re.compile(r"_align(\d+)\b")
#: the element size a kernel name implies: 16-bit types, else 4 bytes (fp32/tf32)
_HALF_WORDS = ("bf16", "f16", "fp16", "half", "_h1688", "_h16816")
#: a dimension is aligned when it is a multiple of this many elements of a 16-bit type
ALIGNED_ELEMENTS_16BIT = ALIGNED_BYTES // 2


def misaligned(name: str) -> bool:
    """Whether a matmul kernel's name says it loads its operands in under 16 bytes."""
    m = _ALIGN.search(name)
    if not m or not is_matmul_kernel(name):
        return False
    item = 2 if any(w in name.lower() for w in _HALF_WORDS) else 4
    return int(m.group(1)) * item < ALIGNED_BYTES


def _odd_dims(dims: str) -> list[int]:
    """The matrix dimensions (last two of each input) that are not multiples of 8 elements."""
    out: list[int] = []
    for d in parse_dims(dims):
        if isinstance(d, list) and len(d) >= 2 and all(isinstance(x, int) for x in d):
            out += [x for x in d[-2:] if x % ALIGNED_ELEMENTS_16BIT and x not in out]
    return out


def _label(col, code: int) -> str:
    """A string column's value for ``code`` ("" for a missing value, code -1)."""
    return col.labels[code] if code >= 0 else ""


def _calls(f: RankFacts) -> dict[int, dict]:
    """Per launching matmul op call (tree node), in launch order: its graph ops, kernel time,
    FLOPs (None without shapes), whether a kernel of it is misaligned and whether it ran on
    tensor cores."""
    g, t, o = f.graph, f.tree, f.rt.ops
    k = f.rt.kernels
    if not g.n_ops or not len(k) or not len(o):
        return {}
    ko = kernel_ops(f)
    kern = np.nonzero((g.o_table == 0) & (ko.op_node >= 0))[0]
    onames = o.strings("name")
    # names, shapes and kernels are tested once per distinct value (tens of thousands of ops)
    is_mm = np.array([x in MATMUL_OPS for x in onames.labels] + [False])
    kern = kern[is_mm[onames.codes[t.row[ko.op_node[kern]]]]]
    if not len(kern):
        return {}
    names = k.strings("name")
    bad_code = np.array([misaligned(s) for s in names.labels] + [False])
    tc_code = np.array([is_tensor_core_kernel(s) for s in names.labels] + [False])
    kcode = names.codes[g.o_row[kern]]
    nodes, first, inv = np.unique(ko.op_node[kern], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # the calls in launch order, as the ops run
    # sums in op order, as a loop over the ops adds them
    ns = np.bincount(inv, weights=g.o_dur[kern], minlength=len(nodes))
    bad = np.bincount(inv, weights=bad_code[kcode], minlength=len(nodes)) > 0
    tc = np.bincount(inv, weights=tc_code[kcode], minlength=len(nodes)) > 0
    by_call = np.argsort(inv, kind="stable")
    ops = np.split(kern[by_call], np.cumsum(np.bincount(inv, minlength=len(nodes)))[:-1])
    dims = o.strings("input_dims") if "input_dims" in o else None
    types = o.strings("input_types") if "input_types" in o else None
    work: dict[tuple[str, int, int], tuple[float, float] | None] = {}  # calls repeat a few shapes
    calls: dict[int, dict] = {}
    for j in order.tolist():
        node = int(nodes[j])
        row = int(t.row[node])
        op = onames.labels[onames.codes[row]]
        d = _label(dims, int(dims.codes[row])) if dims is not None else ""
        w = None
        if dims is not None and types is not None:
            key = (op, int(dims.codes[row]), int(types.codes[row]))
            if key not in work:
                work[key] = op_work(op, d, _label(types, key[2]))
            w = work[key]
        calls[node] = {"op": op, "dims": d, "ops": ops[j].tolist(), "ns": float(ns[j]),
                       "flops": w[0] if w else None, "bad": bool(bad[j]), "tc": bool(tc[j])}
    return calls


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu:
        return []
    calls = _calls(f)
    bad = [(n, c) for n, c in calls.items() if c["bad"]]
    if not bad:
        return []
    good = [c for c in calls.values() if c["tc"] and not c["bad"] and c["flops"]]
    flops, sec = sum(c["flops"] for c in good), sum(c["ns"] for c in good) / 1e9
    if not (flops > 0 and sec > 0) or any(c["flops"] is None for _, c in bad):
        return []  # no aligned rate to price at, or no shapes to count the FLOPs: no what-if
    rate = flops / sec
    g = f.graph
    e = f.edit(CODE)
    slow_ns = fast_ns = 0.0
    for _, c in bad:
        ops = np.array(sorted(c["ops"], key=lambda i: -g.o_dur[i]))
        new = c["flops"] / rate * 1e9
        if new >= c["ns"]:
            continue
        slow_ns += c["ns"]
        fast_ns += new
        e.op_dur[ops[0]] = new
        if len(ops) > 1:
            drop_kernels(e, g, ops[1:])
    if slow_ns <= fast_ns:
        return []
    per = f.n_steps
    top_node, top = max(bad, key=lambda nc: nc[1]["ns"])
    odd = sorted({x for _, c in bad for x in _odd_dims(c["dims"])})
    site, stack = site_and_stack(f, top_node)
    dims_txt = (f"dimension{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd[:4]))} not a multiple of 8"
                if odd else "an operand not aligned to 16 bytes")
    k = f.rt.kernels.strings("name")
    kernel = k.labels[k.codes[g.o_row[max(top["ops"], key=lambda i: g.o_dur[i])]]]
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(slow_ns / per)} per step in {len(bad) / per:.0f} matrix products on cuBLAS's slow path: "
               f"{dims_txt}{' at ' + site if site else ''}"),
        mechanism=("cuBLAS's fast tensor-core kernels need each matrix's leading dimension to be a multiple of 8 "
                   "elements (16 bytes) in fp16/bf16; otherwise it runs kernels that load one or two elements at a "
                   "time, at a fraction of the tensor cores' rate."),
        remedy=("Pad the dimension to a multiple of 8, better 64: e.g. a vocabulary of 50257 to 50304 (extra "
                "rows of the embedding and LM head that no token uses), hidden and head sizes likewise "
                "(PyTorch Performance Tuning Guide: use sizes that are multiples of 8)."
                + (f" Here: {', '.join(map(str, odd[:4]))}." if odd else "")),
        place=Place("python" if site else "op", site or top["op"], site, stack),
        evidence={"calls_per_step": len(bad) / per, "slow_us_per_step": slow_ns / per / 1e3,
                  "aligned_us_per_step": fast_ns / per / 1e3, "odd_dims": odd, "kernel": kernel,
                  "aligned_tensor_core_tflops": rate / 1e12},
        edit=e, claims=[Claim(SLOW_KERNELS, f.rank, (slow_ns - fast_ns) / 1e3)])]


# no ``acts_on``: every rank runs the same shapes (a straggler's longer inputs are STRAGGLER's)
DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect)
