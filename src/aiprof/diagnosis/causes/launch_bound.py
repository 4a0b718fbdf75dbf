"""LAUNCH_BOUND: the host cannot launch kernels as fast as the GPU runs them.

Mechanism: every eager op costs Python, dispatch and a kernel launch on the host (several
microseconds, more under the profiler); when the kernels are short, the GPU finishes each
before the next is queued and idles between them. CUDA graphs (torch.cuda.graphs, or
torch.compile(mode="reduce-overhead")) record the launches once and replay them with one call.

Evidence: GPU-idle time while the host dispatches ops and launches kernels, outside the regions
more specific causes own (a for-loop optimizer, host syncs, data loading, pure-Python work)
and outside the distributed wrappers' own hooks and collectives (FSDP's unshard and reshard,
DDP's reducer): a CUDA graph of the model does not replay those, they stay on the host.
Fix priced: the host time of op dispatch, module Python and launches in the remaining region
removed, its kernels launched from a graph (spaced by the measured graph gap).
"""
from __future__ import annotations

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import OP, PYTHON
from aiprof.diagnosis.causes.common import idle_claim, ms
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import LAUNCH, is_graph_launch
from aiprof.diagnosis.model import Cause, Place
from aiprof.trace import classify

CODE = "LAUNCH_BOUND"
# Spacing of consecutive kernels replayed from a CUDA graph: 0.26 µs median measured on the lent
# H100 (2,000 one-element kernels in a graph, bench/diagnosis/gpu_pairs.py calibration).
GRAPH_KERNEL_GAP_NS = 260.0
# A trace with graph launches (graph.is_graph_launch) already replays CUDA graphs (torch.compile
# "reduce-overhead", or the job's own torch.cuda.graphs): the remedy then names the launches left
# outside the graphs by their ops, the largest this many.
OUTSIDE_OPS_NAMED = 4
# Frames that a graph capture replaces: torch's module machinery and the model's forward code.
_GRAPHABLE_FRAMES = ("nn.Module:", "torch/nn/", "transformers/models/", "torch/_tensor.py", "torch/functional.py")
# The distributed wrappers' hooks and collectives, which run around and inside those frames but
# are not part of what a graph of the model replays: Python frames of torch.distributed, and (as
# without Python stacks) FSDP's and c10d's annotations and ops.
_DISTRIBUTED_FRAMES = ("torch/distributed/",)
_DISTRIBUTED_EVENTS = ("FSDP::", "fsdp::", "c10d::", "nccl:", "record_param_comms")


def _distributed(s: str) -> bool:
    return s.startswith(_DISTRIBUTED_EVENTS) or any(p in s for p in _DISTRIBUTED_FRAMES)


def graph_fix(f: RankFacts, code: str, claimed: np.ndarray, within: np.ndarray | None = None,
              actions: np.ndarray | None = None):
    """The CUDA-graph fix of the graphable host region outside ``claimed`` (restricted to the
    nodes ``within`` and the replay ``actions`` when given): its dispatch, module Python and
    launch costs removed and its kernels replayed back to back. Returns (edit, launch-action
    mask, region nodes, claims), or None when the region launches nothing or idles no GPU."""
    g = f.graph
    ops = f.tree.kind == OP if len(f.tree) else np.zeros(0, dtype=bool)
    claimed = claimed | f.under(f.node_mask(_distributed))
    graphable = (ops | f.node_mask(lambda s: s.startswith(_GRAPHABLE_FRAMES), (PYTHON,))) & ~claimed
    if within is not None:
        graphable &= within
    if not graphable.any():
        return None
    region = f.under(graphable) & ~claimed
    if within is not None:
        region &= within
    # a graph launch already replays its ops from a graph, ordered by the graph's edges: not packed again
    replays = np.array([is_graph_launch(n) for n in g.a_name] + [False], dtype=bool)[g.a_code]
    acts = f.actions_in(region) & (g.a_kind == LAUNCH) & (g.a_wait < 0) & ~replays
    if actions is not None:
        acts &= actions
    if not acts.any():
        return None
    e = f.edit(code)
    e.cost_remove[acts] = g.cost[acts]
    gap = np.where(f.actions_in(claimed), 0.0, f.gap_time_in(f.union_of_nodes(graphable & ~f.under(claimed))))
    e.gap_remove += gap if actions is None else np.where(actions, gap, 0.0)
    e.packed[acts[g.o_action]] = True
    e.packed_gap_ns = GRAPH_KERNEL_GAP_NS
    claims = idle_claim(f, region)
    if not claims:
        return None
    return e, acts, region, claims


def _outside_ops(f: RankFacts, acts: np.ndarray) -> list[tuple[str, int]]:
    """The outermost ops that make the region's launches, by launches (most first)."""
    tree = f.tree
    nodes = f.action_nodes()[acts]
    top = tree.outermost(nodes[nodes >= 0], OP)
    codes, n = npx.unique(tree.code[top[top >= 0]], return_counts=True)
    counts: dict[str, int] = {}
    for c, k in zip(codes.tolist(), n.tolist()):
        name = tree.labels[c]
        counts[name] = counts.get(name, 0) + k
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    if not f.has_gpu or not g.n_ops:
        return []
    claimed = f.extra.get("claimed_nodes")
    claimed = claimed if claimed is not None and len(claimed) == len(f.tree) else np.zeros(len(f.tree), dtype=bool)
    fix = graph_fix(f, CODE, claimed)
    if fix is None:
        return []
    e, acts, region, claims = fix
    per = max(len(f.steps), 1)
    n_launch = int(acts.sum())
    kd = g.o_dur[acts[g.o_action]]
    compiled = any(s.startswith(("Torch-Compiled Region", "CompiledFunction")) for s in f.tree.labels)
    graphs = any(is_graph_launch(n) for n in g.a_name)
    outside = _outside_ops(f, acts)
    if graphs:
        # the job already replays CUDA graphs: what is left are the launches outside them
        where = ", ".join(f"{op} ({n})" for op, n in outside[:OUTSIDE_OPS_NAMED]) or "other ops"
        remedy = (f"The step already replays CUDA graphs; the launches left are outside them, from {where} "
                  "(launches per analysed window): bring those ops into the graphed region (compile the loss "
                  "with the model, the optimizer step with torch.compile, or capture the whole step) or use "
                  "fused versions (an optimizer with fused=True).")
    elif any(s.startswith(classify.FSDP_ANNOTATIONS) for s in f.tree.labels):  # a job wrapped in FSDP
        # FSDP's hooks (unshard, reshard, reduce-scatter) run between the wrapped modules and wait on
        # its streams: no one graph spans the step, each module's own compute can be compiled
        if compiled:
            where = ", ".join(f"{op} ({n})" for op, n in outside[:OUTSIDE_OPS_NAMED]) or "other ops"
            # compiled code still launches kernel by kernel without a graph: more work per launch is left
            remedy = ("FSDP's hooks run between its wrapped modules, so one CUDA graph cannot replay the step, and "
                      f"compiled code already runs in it, still one launch per kernel; most launches come from {where} "
                      "(launches per analysed window). Give each rank more work per step (more sequences per rank) so "
                      "its kernels outlast their launches.")
        else:
            remedy = ("FSDP's hooks run between its wrapped modules, so one CUDA graph cannot replay the step: compile "
                      "each wrapped module (torch.compile(block.forward) on each block, FSDP's hooks left eager) to "
                      "fuse its small ops and cut its launches, or give each rank more work per step (more sequences "
                      "per rank) so its kernels outlast their launches.")
    else:
        remedy = ("Replay the step's launches from a CUDA graph: torch.compile(model, mode=\"reduce-overhead\")"
                  if compiled else
                  "Capture the forward (or the whole step) once as a CUDA graph and replay it: torch.cuda.graphs / "
                  "torch.cuda.make_graphed_callables, or torch.compile(model, mode=\"reduce-overhead\"), which also "
                  "fuses small ops") + "; static input shapes and no host syncs inside the captured region are required."
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"the host launches kernels slower than the GPU runs them: {n_launch / per:.0f} launches per step, "
               f"median kernel {float(np.median(kd)) / 1e3:.1f} µs, the GPU idles {ms(claims[0].us * 1e3 / per)} "
               "per step between them"),
        mechanism=("Each eager op costs Python, dispatch and a launch on the host; short kernels finish before "
                   "the next launch arrives, so the GPU waits for the host."),
        remedy=remedy, place=Place("step", "ops outside the CUDA graphs" if graphs else "model forward/backward", "", [], []),
        evidence={"launches_per_step": n_launch / per, "median_kernel_us": float(np.median(kd)) / 1e3,
                  "graph_kernel_gap_ns": GRAPH_KERNEL_GAP_NS, "compiled": compiled, "cuda_graphs": graphs,
                  "launching_ops": [{"op": op, "launches": n} for op, n in outside[:OUTSIDE_OPS_NAMED]]},
        edit=e, claims=claims, region=region)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "has_gpu", "steps", "tree"), detect=detect, generic=True,
                    acts_on=("host: op dispatch", "host: cuda runtime", "host: python"))
