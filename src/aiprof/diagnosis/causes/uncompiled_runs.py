"""UNCOMPILED_KERNEL_RUNS: a model run eagerly, whose memory-bound ATen kernels between two
matmuls (or convolutions, or attention kernels) torch.compile would fuse into one.

Mechanism: in eager mode every op of a module's forward and of its backward is its own ATen
kernel (a residual add, a LayerNorm, a GELU, a dtype cast, a batch norm and its ReLU, their
gradients), reading its inputs from GPU memory and writing its output back. TorchInductor
(``torch.compile``) generates one kernel for each run of such ops between two library kernels
(cuBLAS, cuDNN, attention), so the tensors of the run go through memory once. UNFUSED_POINTWISE
is the special case of a function written out in elementwise ops (its fix is a fused op); this is
what is left for the compiler. PyTorch's Performance Tuning Guide: "fuse pointwise operations".

Evidence (GPU traces with Python stacks): on one stream, a run of at least ``MIN_RUN_KERNELS``
consecutive ATen kernels (family ``at::native::``; no library kernel, copy or other kernel between
them) launched inside a module's forward (a Python ``forward`` frame or the profiler's
``nn.Module:`` event above the launching op) or by autograd's backward of such an op. Left out:
kernels outside the modules (the loss, the optimizer: ``torch.compile(model)`` leaves them eager),
and those earlier causes fix (EAGER_ATTENTION's region, UNFUSED_POINTWISE's chains, the NCHW
batch norms of CONV_LAYOUT_CONVERSION). Without Python stacks the modules are unknown and no run
is claimed.

Fix priced: each run as one kernel taking as long as the run's longest kernel (a fused kernel
reads the run's inputs and writes its outputs once; the longest kernel of the run moves about
that much), the other kernels, their launches and their ops' dispatch gone. One other effect of compiling is priced,
as it follows from the trace: transformers' SDPA attention skips its causal mask (``is_causal``)
only when not traced, so a compiled transformers model passes SDPA a dense [B, 1, L, L] mask
(seen in the compiled GPT-2 captures), which turns off the kernel's causal block skipping: its
attention kernels at ``DENSE_MASK_FACTOR`` times their time (measured 2.2x and 2.4x on GPT-2).
The compiler's other choices are not priced (docs/findings.md, Validation).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP, PYTHON
from aiprof.analysis.rankdiff import parse_dims
from aiprof.diagnosis.causes import conv_layout, eager_attention, unfused_pointwise
from aiprof.diagnosis.causes.common import drop_kernels, ms, owned_before, python_frame, site_and_stack, stream_runs
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.kernel_ops import backward_node_seq, forward_of, kernel_ops
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "UNCOMPILED_KERNEL_RUNS"
#: ATen's own CUDA kernels (elementwise, reductions, norms, softmax, pooling, copies, cat): what
#: Inductor generates instead; cuBLAS, cuDNN and attention kernels stay library calls when compiled
ATEN_FAMILY_PREFIX = "at::native::"
#: kernels in a run before it fuses: two kernels over the same tensor are one pass too many
MIN_RUN_KERNELS = 2
#: the profiler's event for a module call (with Python stacks)
MODULE_EVENT_PREFIX = "nn.Module: "
#: transformers' code (a frame's path): its SDPA attention skips the causal mask only when not
#: traced (masking_utils), so compiled it passes a dense mask
TRANSFORMERS_PATH = "transformers/"
SDPA_OP = "aten::scaled_dot_product_attention"
#: SDPA's input that is the mask (query, key, value, attn_mask, ...)
SDPA_MASK_INPUT = 3
#: a dense mask turns off the attention kernel's causal block skipping: it computes every block of
#: the L x L scores, twice the causal half (the compiled GPT-2 pairs measured 2.2x and 2.4x: the
#: mask's reads on top)
DENSE_MASK_FACTOR = 2.0


def _is_sdpa(name: str) -> bool:
    """One function, not a lambda per call: RankFacts.node_mask caches by the predicate."""
    return name == SDPA_OP


def _is_module_frame(name: str) -> bool:
    """A module's call: its ``forward`` frame, or the profiler's ``nn.Module:`` event."""
    return name.startswith(MODULE_EVENT_PREFIX) or python_frame(name)[1] == "forward"


def in_modules(f: RankFacts) -> np.ndarray:
    """Per graph op: launched inside a module's forward, or by the backward of an op that was."""
    g, t = f.graph, f.tree
    out = np.zeros(g.n_ops, dtype=bool)
    if not g.n_ops or not len(t):
        return out
    inside = f.under(f.node_mask(_is_module_frame, (PYTHON,)))
    if not inside.any():
        return out
    ko = kernel_ops(f)
    node = ko.op_node.copy()
    seq = backward_node_seq(f, node)
    fwd = forward_of(f)
    bw = np.nonzero(seq >= 0)[0]
    node[bw] = [fwd.get(int(s), -1) for s in seq[bw].tolist()]
    ok = node >= 0
    out[ok] = inside[node[ok]]
    return out


def causal_sdpa_in_transformers(f: RankFacts) -> np.ndarray:
    """Per graph op: a kernel of a transformers SDPA call without a mask (forward, or the backward
    of it), which a compiled model runs with a dense mask instead."""
    g, t, o = f.graph, f.tree, f.rt.ops
    out = np.zeros(g.n_ops, dtype=bool)
    if not g.n_ops or not len(t) or "input_dims" not in o:
        return out
    calls = np.nonzero(f.node_mask(_is_sdpa, (OP,)))[0]
    dims = o.strings("input_dims")
    causal = np.zeros(len(t), dtype=bool)
    for node in calls.tolist():
        ins = parse_dims(dims.labels[dims.codes[t.row[node]]])
        no_mask = len(ins) > SDPA_MASK_INPUT and ins[SDPA_MASK_INPUT] == []
        if no_mask and any(TRANSFORMERS_PATH in frame for frame in t.stack(node)):
            causal[node] = True
    if not causal.any():
        return out
    under = f.under(causal)
    ko = kernel_ops(f)
    has_op = ko.op_node >= 0
    out[has_op] = under[ko.op_node[has_op]]
    seqs = o["seq"][t.row[np.nonzero(under & (t.kind == OP))[0]]] if "seq" in o else np.zeros(0, np.int64)
    seqs = seqs[seqs >= 0]
    if len(seqs):
        out |= np.isin(backward_node_seq(f, ko.op_node), seqs) & has_op
    out &= ko.family_mask(lambda fam: fam != "" and not fam.startswith(ATEN_FAMILY_PREFIX))
    return out


def runs(f: RankFacts) -> list[np.ndarray]:
    """The rank's fusible runs (graph op indices each, in launch order); see the module docstring."""
    got = f.extra.get("_uncompiled_runs")
    if got is not None:
        return got
    g = f.graph
    out: list[np.ndarray] = []
    if g.n_ops:
        ko = kernel_ops(f)
        member = ko.family_mask(lambda fam: fam.startswith(ATEN_FAMILY_PREFIX))
        member &= in_modules(f)
        member &= ~owned_before(f, CODE)[g.o_action]  # the same at this detector's turn and after every rank's
        # the kernels an earlier cause's fix removes or replaces are boundaries, not members
        for fwd, bwd in eager_attention.region_ops(f):
            member[fwd] = member[bwd] = False
        for chain in unfused_pointwise.chains(f):
            member[chain] = False
        if conv_layout.conversions(f).any():
            member &= ~conv_layout.nchw_batch_norm(f)
        out = stream_runs(g, member, MIN_RUN_KERNELS)
    f.extra["_uncompiled_runs"] = out
    return out


def has_runs(f: RankFacts) -> bool:
    """Whether the rank runs fusible eager kernels (the job cause's condition on every rank)."""
    return f.has_gpu and bool(runs(f))


def rank_cause(f: RankFacts) -> Cause | None:
    """The rank's cause: its runs, each priced as one kernel; None without runs."""
    if not has_runs(f):
        return None
    found = runs(f)
    g, t = f.graph, f.tree
    ko = kernel_ops(f)
    e = f.edit(CODE)
    run_ns = kept_ns = 0.0
    by_site: dict[int, float] = {}
    op_ns: dict[str, float] = {}
    dispatch = np.zeros(len(t), dtype=bool)  # the ops whose kernels fuse into another's
    sites = unfused_pointwise.site_nodes(f, [int(ko.op_node[run[0]]) for run in found])
    for run, site in zip(found, sites):
        keep = int(run[np.argmax(g.o_dur[run])])
        gone = run[run != keep]
        drop_kernels(e, g, gone)
        nodes = ko.op_node[gone]
        dispatch[nodes[nodes >= 0]] = True
        ns = float(g.o_dur[run].sum())
        run_ns += ns
        kept_ns += float(g.o_dur[keep])
        by_site[site] = by_site.get(site, 0.0) + ns - float(g.o_dur[keep])
        for i in run.tolist():
            node = int(ko.op_node[i])
            name = t.name(node) if node >= 0 and t.kind[node] == OP else "?"
            op_ns[name] = op_ns.get(name, 0.0) + float(g.o_dur[i])
    # compiled, those ops are not dispatched one by one: one generated kernel is launched instead
    e.gap_remove += f.gap_time_in(f.union_of_nodes(dispatch))
    masked = causal_sdpa_in_transformers(f)
    extra_ns = float(g.o_dur[masked].sum()) * (DENSE_MASK_FACTOR - 1)
    if masked.any():
        e.op_dur[masked] = g.o_dur[masked] * DENSE_MASK_FACTOR
    per = f.n_steps
    kernels = int(sum(len(r) for r in found))
    top_site = max(by_site, key=by_site.get)
    site, stack = site_and_stack(f, top_site)
    ops = [op for op, _ in sorted(op_ns.items(), key=lambda kv: -kv[1])]
    where = f"; the most in {site}" if site else ""
    mask_note = (f" Compiled, transformers passes SDPA a dense causal mask: its attention kernels, "
                 f"{ms(float(g.o_dur[masked].sum()) / per)} per step now, run without causal block skipping "
                 f"(about {DENSE_MASK_FACTOR:.0f}x, priced in)." if masked.any() else "")
    return Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(run_ns / per)} per step in {len(found) / per:.0f} runs of eager ATen kernels between matmuls "
               f"({kernels / per:.0f} kernels per step: {', '.join(o.removeprefix('aten::') for o in ops[:4])}"
               f"{where})"),
        mechanism=("Run eagerly, every op of the model's forward and backward is its own kernel, reading its inputs "
                   "from GPU memory and writing its output back. torch.compile generates one kernel for each run of "
                   "such ops between two matmuls, so the run's tensors go through memory once."),
        remedy=("Compile the model: model = torch.compile(model), or each block (block.compile(), as with FSDP); "
                "the loss and the optimizer step can be compiled too. Time it: the compiler's other choices (copies "
                "it removes, kernels it picks) are not priced here (PyTorch Performance Tuning Guide: fuse pointwise "
                "operations)." + mask_note),
        place=Place("python" if site else "op", site or ops[0], site, stack),
        evidence={"runs": len(found), "runs_per_step": len(found) / per, "kernels_per_step": kernels / per,
                  "run_us_per_step": run_ns / per / 1e3, "fused_us_per_step": kept_ns / per / 1e3,
                  "ops": ops[:8], "dense_mask_attention_us_per_step": float(g.o_dur[masked].sum()) / per / 1e3},
        edit=e, claims=[Claim(SLOW_KERNELS, f.rank, max(run_ns - kept_ns - extra_ns, 0.0) / 1e3)])


def detect(f: RankFacts) -> list[Cause]:
    c = rank_cause(f)
    return [c] if c else []


def detect_job(job: JobFacts) -> list[Cause]:
    """One cause for a job whose ranks collectives couple: the model is compiled on every rank,
    so every rank's runs are fused at once (one rank's alone would still wait for the others at
    each collective). Titled by the first rank's runs."""
    facts = job.facts
    if not facts or not all(has_runs(f) for f in facts):
        return []
    causes = {f.rank: rank_cause(f) for f in facts}
    f0 = facts[0]
    c = causes[f0.rank]
    c.rank = None
    # a job cause links each rank's symptom without a per-rank amount: a scaled-out analysis finds
    # it on a rank and its partner only (pipeline.job_claims)
    c.claims = [Claim(SLOW_KERNELS, f.rank, 0.0) for f in facts]
    job.pricer.price(f0, c, None, {r: x.edit for r, x in causes.items() if r != f0.rank})
    return [c]


# a rank alone (or uncoupled): priced on it; a coupled job: the fix made on every rank at once
ON_ONE_RANK = Detector(CODE, Scope.UNCOUPLED, reads=("graph", "rt", "steps", "tree"), detect=detect)
DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer"), detect=detect_job, every_rank=has_runs)
