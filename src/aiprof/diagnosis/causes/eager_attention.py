"""EAGER_ATTENTION: attention computed op by op (matmul, scale, mask, softmax, dropout, matmul)
instead of by one fused kernel.

Mechanism: eager attention materialises the [batch, heads, L, S] score matrix in GPU memory and
passes over it once per op (the scale, the mask, the softmax, the dropout, in forward and again in
backward), a traffic that grows with L x S; under autocast the softmax's output is even fp32.
``F.scaled_dot_product_attention`` (flash or memory-efficient kernels) keeps the scores on chip
and makes one pass over q, k and v. PyTorch's Performance Tuning Guide and the transformers
library (``attn_implementation="sdpa"``) both say so.

Evidence (GPU traces with ``--what shapes``): a softmax op over a tensor of three or more
dimensions [..., L, S], between two matrix products that are its neighbours under the same caller
(at most ``MAX_BETWEEN`` ops apart): one whose inputs are [..., L, E] and [..., E, S] (the scores)
and one whose inputs are [..., L, S] and [..., S, E] (the weighted values). The region is the
ops from the first product to the second; its backward is the backward functions whose sequence
numbers are the region's forward ops'.

Fix priced: the region's kernels in forward, and those of its backward, each replaced by one kernel
that does the attention's FLOPs (4 B L S E forward, ``ATTENTION_BACKWARD_FACTOR`` times that
backward) at the tensor-core rate this rank's matrix products reached (FLOPs over time of its
tensor-core matmul families, roofline); the other kernels and their launches are gone. A causal
mask would halve the fused kernel's work; it is not assumed.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.flops import ATTENTION_BACKWARD_FACTOR
from aiprof.analysis.hotspots import ANNOTATION, OP, PYTHON
from aiprof.analysis.rankdiff import parse_dims
from aiprof.analysis.roofline import roofline
from aiprof.diagnosis.causes.common import drop_kernels, ms, site_and_stack
from aiprof.diagnosis.kernel_ops import backward_node_seq, kernel_ops
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "EAGER_ATTENTION"
SOFTMAX_OPS = ("aten::softmax", "aten::_softmax", "aten::_safe_softmax")
PRODUCT_OPS = ("aten::matmul", "aten::bmm", "aten::baddbmm")
MASK_OPS = ("aten::masked_fill", "aten::masked_fill_", "aten::where", "aten::add", "aten::add_")
#: ops between a product and the softmax (scale, mask, dtype cast) or the softmax and the next
#: product (dropout, cast): eager attention has two to four
MAX_BETWEEN = 8
#: Python frames of torch itself: the op's caller is the frame above them
TORCH_FRAMES = ("<built-in", "torch/")
#: the fused kernel's FLOPs per multiply-add pair: QK^T and PV are 2 L S E multiply-adds
FLOPS_PER_MAC = 2.0


def _shape(node_dims: str) -> list:
    return [d for d in parse_dims(node_dims) if isinstance(d, list)]


def regions(f: RankFacts) -> list[dict]:
    """Each eager attention found: its forward op nodes, FLOPs and shape (see the docstring)."""
    got = f.extra.get("_eager_attention")
    if got is not None:
        return got
    out: list[dict] = []
    t, o = f.tree, f.rt.ops
    f.extra["_eager_attention"] = out
    if not len(t) or not len(o) or "input_dims" not in o:
        return out
    is_op = t.kind == OP
    par = t.parent
    top = is_op & ((par < 0) | ~is_op[np.maximum(par, 0)])  # ops called from outside any op
    idx = np.nonzero(top)[0]
    if not len(idx):
        return out
    caller = _callers(f, idx)
    idx_order = np.lexsort((t.start[idx], t.tid[idx], caller))
    idx, caller = idx[idx_order], caller[idx_order]
    group = np.c_[caller, t.tid[idx]]
    names = [t.labels[c] for c in t.code[idx].tolist()]
    dims = o.strings("input_dims")
    dim_text = [dims.labels[c] for c in dims.codes[t.row[idx]].tolist()]
    for i, name in enumerate(names):
        if name not in SOFTMAX_OPS:
            continue
        x = _shape(dim_text[i])
        if not x or len(x[0]) < 3:
            continue
        lq, s = x[0][-2], x[0][-1]

        def same(j: int) -> bool:
            return bool((group[j] == group[i]).all())

        pre = next((j for j in range(i - 1, max(i - 1 - MAX_BETWEEN, -1), -1)
                    if same(j) and names[j] in PRODUCT_OPS), -1)
        post = next((j for j in range(i + 1, min(i + 1 + MAX_BETWEEN, len(idx)))
                     if same(j) and names[j] in PRODUCT_OPS), -1)
        if pre < 0 or post < 0:
            continue
        a, b = (_shape(dim_text[pre]) + [[], []])[:2]
        c, d = (_shape(dim_text[post]) + [[], []])[:2]
        if names[pre] == "aten::baddbmm":
            a, b = (_shape(dim_text[pre]) + [[], [], []])[1:3]
        if (len(a) < 2 or len(b) < 2 or len(c) < 2 or len(d) < 2 or a[-2] != lq or b[-1] != s
                or a[-1] != b[-2] or c[-2:] != [lq, s] or d[-2] != s):
            continue
        batch = float(np.prod(a[:-2], dtype=np.float64)) if len(a) > 2 else 1.0
        e_qk, e_v = a[-1], d[-1]
        fwd = FLOPS_PER_MAC * batch * lq * s * (e_qk + e_v)
        nodes = idx[pre:post + 1]
        nodes = nodes[(group[pre:post + 1] == group[i]).all(axis=1)]
        out.append({"nodes": nodes, "softmax": int(idx[i]), "flops": fwd, "shape": [int(batch), lq, s, e_qk],
                    "masked": any(names[j] in MASK_OPS for j in range(pre + 1, post) if same(j))})
    return out


def _callers(f: RankFacts, nodes: np.ndarray) -> np.ndarray:
    """Per op node: the model code that called it, its nearest ancestor that is a Python function
    outside torch (``F.softmax``'s own frame and the ``<built-in method ...>`` frame of the op are
    torch's) or an annotation (a module, a record_function); -1 at the top of its thread (a
    capture without Python stacks)."""
    t = f.tree
    plain = f.node_mask(lambda s: not s.startswith(TORCH_FRAMES), (PYTHON, ANNOTATION))
    out = np.full(len(nodes), -1, np.int64)
    cur = t.parent[nodes].copy()
    active = cur >= 0
    while active.any():
        idx = np.nonzero(active)[0]
        hit = plain[cur[idx]]
        out[idx[hit]] = cur[idx[hit]]
        nxt = t.parent[cur[idx]]
        cur[idx] = nxt
        active[idx] = ~hit & (nxt >= 0)
    return out


def _tensor_core_rate(f: RankFacts) -> float | None:
    """FLOP/s the rank's tensor-core matrix products reached (roofline), or None."""
    r = roofline(f.rt)
    fams = [x for x in r.families if "tensor cores" in x.compute_peak]
    flops = sum(x.flops for x in fams)
    sec = sum(x.gpu_us for x in fams) / 1e6
    return flops / sec if flops > 0 and sec > 0 else None


def region_ops(f: RankFacts) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per region of :func:`regions`: its forward and its backward graph ops (kernels and copies)."""
    got = f.extra.get("_eager_attention_ops")
    if got is not None:
        return got
    out: list[tuple[np.ndarray, np.ndarray]] = []
    f.extra["_eager_attention_ops"] = out
    found = regions(f) if f.graph.n_ops else []
    if not found:
        return out
    g, t, o = f.graph, f.tree, f.rt.ops
    ko = kernel_ops(f)
    has_op = ko.op_node >= 0
    bw_seq = np.full(g.n_ops, -1, np.int64)
    bw_seq[has_op] = backward_node_seq(f, ko.op_node[has_op])
    for r in found:
        mask = np.zeros(len(t), dtype=bool)
        mask[r["nodes"]] = True
        under = f.under(mask)
        fwd_ops = np.nonzero(has_op & under[np.maximum(ko.op_node, 0)])[0]
        seqs = o["seq"][t.row[np.nonzero(under & (t.kind == OP))[0]]] if "seq" in o else np.zeros(0, np.int64)
        seqs = seqs[seqs >= 0]
        bwd_ops = np.nonzero(np.isin(bw_seq, seqs))[0] if len(seqs) else np.zeros(0, np.int64)
        out.append((fwd_ops, bwd_ops))
    return out


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu or not f.graph.n_ops:
        return []
    found = regions(f)
    if not found:
        return []
    rate = _tensor_core_rate(f)
    if rate is None:
        return []
    g = f.graph
    e = f.edit(CODE)
    eager_ns = fused_ns = 0.0
    kernels = 0
    for r, (fwd_ops, bwd_ops) in zip(found, region_ops(f)):
        for ops, flops in ((fwd_ops, r["flops"]), (bwd_ops, r["flops"] * ATTENTION_BACKWARD_FACTOR)):
            if not len(ops):
                continue
            new = flops / rate * 1e9
            eager_ns += float(g.o_dur[ops].sum())
            fused_ns += new
            kernels += len(ops)
            e.op_dur[ops[0]] = new
            drop_kernels(e, g, ops[1:])
    if eager_ns <= fused_ns:
        return []
    per = f.n_steps
    first = found[0]
    site, stack = site_and_stack(f, first["softmax"])
    b, lq, s, hd = first["shape"]
    mask_hint = (", is_causal=True for a causal mask (else attn_mask=the mask)" if any(r["masked"] for r in found)
                 else "")
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(eager_ns / per)} per step in {len(found) / per:.0f} attentions computed op by op "
               f"(scores of {b} x {lq} x {s} materialised{' at ' + site if site else ''})"),
        mechanism=("Eager attention writes the [batch, heads, L, S] scores to GPU memory and reads them back once per op "
                   "(scale, mask, softmax, dropout), in forward and in backward; a fused attention kernel keeps them on "
                   "chip and reads q, k and v once."),
        remedy=("Use torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=..." + mask_hint + ") in place of "
                "the matmul-softmax-matmul code (with transformers: attn_implementation=\"sdpa\")."),
        place=Place("python" if site else "op", site or "aten::softmax", site, stack),
        evidence={"attentions": len(found), "attentions_per_step": len(found) / per, "kernels_per_step": kernels / per,
                  "eager_us_per_step": eager_ns / per / 1e3, "fused_us_per_step": fused_ns / per / 1e3,
                  "shape_batch_l_s_e": first["shape"], "tensor_core_tflops": rate / 1e12,
                  "masked": any(r["masked"] for r in found)},
        edit=e, claims=[Claim(SLOW_KERNELS, f.rank, (eager_ns - fused_ns) / 1e3)])]


# no ``acts_on``: the same code runs on every rank, so it is no straggler's cause (a straggler that
# computes more is slower in every kernel, these included: ddp2_slow1's 18.0 ms of chains per step
# on both ranks)
DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect)
