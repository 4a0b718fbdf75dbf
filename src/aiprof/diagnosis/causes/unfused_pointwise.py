"""UNFUSED_POINTWISE: a chain of eager elementwise and reduction kernels over the same large
tensors, where one fused kernel would do.

Mechanism: in eager mode every elementwise or reduction op (``x * 0.5``, ``torch.tanh(x)``,
``x.mean(-1)``) is one TensorIterator kernel that reads its inputs from GPU memory and writes
its output back; over tensors of many MB each such kernel is bound by memory traffic. A function
written out in such ops (a GELU, a LayerNorm or RMSNorm, a loss) makes one full pass over the
tensor per op, in forward and again in backward, where a fused kernel (torch.compile's, or the
library's fused op) reads the inputs once and writes the result once. PyTorch's Performance
Tuning Guide: "fuse pointwise operations".

Evidence (GPU traces): on one stream, a run of consecutive TensorIterator kernels (the families
of ``CHAIN_FAMILIES``, no other kernel between them) with at least ``MIN_FULL_PASSES`` of them
over the run's largest tensor (inputs of at least ``FULL_SHARE`` of its elements; smaller ones,
a bias or a per-row statistic, ride along), which is at least ``MIN_PASS_BYTES``. The launching
ops' recorded shapes give the sizes (``--what shapes``); without them no chain is claimed.

Fix priced: each chain runs as one kernel that takes as long as the chain's longest full pass
(a fused kernel reads the chain's inputs and writes its output once; the longest pass of the
chain, a binary op, moves about that much: two tensors read, one written); the other kernels
and their launches are gone. An estimate: a fused backward may read a saved tensor more.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.diagnosis.causes import eager_attention
from aiprof.diagnosis.causes.common import drop_kernels, ms, owned_actions, site_and_stack, stream_runs
from aiprof.diagnosis.kernel_ops import backward_node_seq, forward_of, kernel_ops
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "UNFUSED_POINTWISE"
#: PyTorch's TensorIterator kernels: one per eager elementwise or reduction op
CHAIN_FAMILIES = frozenset({"at::native::vectorized_elementwise_kernel", "at::native::elementwise_kernel",
                            "at::native::unrolled_elementwise_kernel", "at::native::reduce_kernel"})
#: full passes in a run before it is a chain: two are a single binary op's output and its use
#: (what a fused op itself may launch); from three on, the same tensor goes through memory again
#: for each op of a written-out function
MIN_FULL_PASSES = 3
#: a kernel whose largest input has at least this share of the run's largest is a full pass
#: over it; smaller inputs (a d-element weight, a per-row mean) are the chain's side work
FULL_SHARE = 0.5
#: below this a pass is not traffic-bound: 8 MiB take ~3 µs at an H100's 3.35 TB/s, the order of a
#: kernel's fixed cost; fusing such kernels saves launches, which LAUNCH_BOUND prices
MIN_PASS_BYTES = 8 << 20
#: ops named in the remedy when the chain holds them: a written-out GELU (tanh and a cube, both) and
#: a written-out normalisation (a mean and a square root or variance)
_GELU_OPS = ("aten::tanh", "aten::pow")
_NORM_OPS = ("aten::mean", "aten::sqrt", "aten::rsqrt", "aten::var")


def chains(f: RankFacts) -> list[np.ndarray]:
    """The chains of the rank (graph op indices each, in launch order); see the module docstring."""
    got = f.extra.get("_pointwise_chains")
    if got is not None:
        return got
    g = f.graph
    out: list[np.ndarray] = []
    if g.n_ops:
        ko = kernel_ops(f)
        member = ko.family_mask(lambda fam: fam in CHAIN_FAMILIES)
        for fwd, bwd in eager_attention.region_ops(f):  # EAGER_ATTENTION's kernels: its fix removes them
            member[fwd] = member[bwd] = False
        # kernels launched in a host region an earlier cause owns (a for-loop optimizer's
        # per-tensor updates) are that cause's: its fix removes them
        member &= ~owned_actions(f)[g.o_action]
        for run in stream_runs(g, member, MIN_FULL_PASSES):
            top = int(ko.numel[run].max())
            full = ko.numel[run] >= FULL_SHARE * top
            if top <= 0 or int(full.sum()) < MIN_FULL_PASSES or int(ko.nbytes[run].max()) < MIN_PASS_BYTES:
                continue
            out.append(run)
    f.extra["_pointwise_chains"] = out
    return out


def site_nodes(f: RankFacts, op_nodes: list[int]) -> list[int]:
    """Per op node, the node whose Python site names its chain: the op, or for a backward op the
    forward op it differentiates (the backward thread has no Python frames). One walk up the
    tree for all of them (a rank has thousands of chains)."""
    need = [n for n in op_nodes if n >= 0 and not f.tree.user_site(n)]
    if not need:
        return list(op_nodes)
    seq = dict(zip(need, backward_node_seq(f, np.array(need, dtype=np.int64)).tolist()))
    fwd = forward_of(f)
    return [fwd.get(seq[n], n) if n in seq else n for n in op_nodes]


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu:
        return []
    found = chains(f)
    if not found:
        return []
    g, t = f.graph, f.tree
    ko = kernel_ops(f)
    e = f.edit(CODE)
    chain_ns = 0.0
    kept_ns = 0.0
    op_ns: dict[str, float] = {}
    by_site: dict[int, float] = {}
    sites = site_nodes(f, [int(ko.op_node[run[0]]) for run in found])
    for run, site in zip(found, sites):
        full = ko.numel[run] >= FULL_SHARE * ko.numel[run].max()
        keep = int(run[full][np.argmax(g.o_dur[run[full]])])
        drop_kernels(e, g, run[run != keep])
        ns = float(g.o_dur[run].sum())
        chain_ns += ns
        kept_ns += float(g.o_dur[keep])
        by_site[site] = by_site.get(site, 0.0) + ns
        for i in run.tolist():
            node = int(ko.op_node[i])
            name = t.name(node) if node >= 0 and t.kind[node] == OP else "?"
            op_ns[name] = op_ns.get(name, 0.0) + float(g.o_dur[i])
    per = f.n_steps
    kernels = int(sum(len(r) for r in found))
    top_site = max(by_site, key=by_site.get)
    site, stack = site_and_stack(f, top_site)
    ops = [op for op, _ in sorted(op_ns.items(), key=lambda kv: -kv[1])]
    fused = []
    if all(op in ops for op in _GELU_OPS):  # both: a pow alone may be a variance
        fused.append("F.gelu(x, approximate='tanh') for a GELU written out in tanh and pow")
    if "aten::mean" in ops and any(op in ops for op in _NORM_OPS[1:]):
        fused.append("F.layer_norm / F.rms_norm for a normalisation written out in mean and sqrt")
    where = f"; the largest at {site}" if site else ""
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(chain_ns / per)} per step in {len(found) / per:.0f} chains of eager elementwise kernels "
               f"({kernels / per:.0f} kernels per step, each a pass over the same tensors{where})"),
        mechanism=("Each eager elementwise or reduction op is its own kernel: it reads its inputs from GPU memory and "
                   "writes its output back. A function written out in such ops makes one full pass over the tensor "
                   "per op, in forward and again in backward; fused, it reads them once and writes once."),
        remedy=("Fuse the chain: torch.compile the module or function that runs it"
                + (", or use the fused op: " + "; ".join(fused) if fused else "")
                + " (PyTorch Performance Tuning Guide: fuse pointwise operations)."),
        place=Place("python" if site else "op", site or ops[0], site, stack),
        evidence={"chains": len(found), "chains_per_step": len(found) / per, "kernels_per_step": kernels / per,
                  "chain_us_per_step": chain_ns / per / 1e3, "fused_us_per_step": kept_ns / per / 1e3,
                  "ops": ops[:8], "largest_pass_mb": float(max(ko.nbytes[r].max() for r in found)) / 2**20},
        edit=e, claims=[Claim(SLOW_KERNELS, f.rank, (chain_ns - kept_ns) / 1e3)])]


# no ``acts_on``: the same code runs on every rank, so it is no straggler's cause (a straggler that
# computes more is slower in every kernel, these included: ddp2_slow1's 18.0 ms of chains per step
# on both ranks)
DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect)
