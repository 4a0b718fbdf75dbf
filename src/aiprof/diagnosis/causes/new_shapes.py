"""NEW_INPUT_SHAPES: per-shape setup work repeated because the input shapes keep changing.

Mechanism: libraries build and cache a plan per input shape: cuDNN with
``torch.backends.cudnn.benchmark=True`` times every algorithm for a new convolution shape
(running each and synchronising the device), torch.compile recompiles a graph for a new shape,
Triton autotunes. A steady job pays this once; a job whose shapes change every step (variable
image sizes, sequence lengths) pays it every step.

Evidence: compute ops that block the host on the GPU (an op that only computes never does:
cuDNN's search does), or compile/autotune frames, inside the analysed steps, with the shapes
they saw. Fix priced: the search's host time, waits and trial kernels removed; the run that
follows the last trial is kept.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP, PYTHON, RUNTIME
from aiprof.diagnosis.causes.common import (
    biggest_node,
    idle_claim,
    ms,
    outermost,
    site_and_stack,
    steps_with,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import SYNC
from aiprof.diagnosis.model import Cause, Place
from aiprof.trace import classify

CODE = "NEW_INPUT_SHAPES"
# Ops whose synchronisations are cuDNN's algorithm search (benchmark mode).
_SEARCH_OPS = ("aten::cudnn_convolution", "aten::convolution_backward", "aten::cudnn_convolution_transpose",
               "aten::_convolution", "aten::convolution")
# Frames of torch.compile's (re)compilation and of Triton/Inductor autotuning.
_COMPILE_FRAMES = ("torch/_dynamo/convert_frame.py", "torch/_inductor/compile_fx.py", "triton/runtime/autotuner.py",
                   "torch/_inductor/runtime/triton_heuristics.py(", "torch/_inductor/select_algorithm.py")
_COMPILE_FUNCS = ("_compile", "compile_inner", "compile_fx", "autotune", "benchmark_all_configs", "_bench",
                  "precompile")
# Setup in at least this many analysed steps (or all of them) is a per-step cost, not warm-up.
MIN_STEPS = 2


def _compile_frame(name: str) -> bool:
    return name.startswith(_COMPILE_FRAMES) and name.rsplit(": ", 1)[-1] in _COMPILE_FUNCS


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    syncs = f.node_mask(classify.is_sync_call, (RUNTIME,))
    search_ops = f.node_mask(lambda s: s.startswith(_SEARCH_OPS), (OP,))
    # search ops = outermost conv ops that contain a sync
    holder = np.zeros(len(f.tree), dtype=bool)
    if syncs.any() and search_ops.any():
        anc = f.tree.parent.copy()
        cur = np.nonzero(syncs)[0]
        a = anc[cur]
        while len(a):
            hit = a >= 0
            a = a[hit]
            holder[a[search_ops[a]]] = True
            a = anc[a]
    holder = outermost(f, holder)
    compile_nodes = outermost(f, f.node_mask(_compile_frame, (PYTHON,)))
    roots = holder | compile_nodes
    if not roots.any():
        return []
    steps = steps_with(f, roots)
    if len(steps) < min(MIN_STEPS, len(f.steps)):
        return []
    e = f.edit(CODE)
    region = f.under(roots)
    acts = f.actions_in(region)
    # per setup call: everything up to its last sync is search (trials, waits, host work); what
    # follows is the real run. Compile frames: all of it is setup.
    search_acts = np.zeros(g.n_actions, dtype=bool)
    nodes = f.action_nodes()
    for r in np.nonzero(roots)[0]:
        inside = np.nonzero(acts & (nodes >= 0))[0]
        inside = inside[(f.tree.start[nodes[inside]] >= f.tree.start[r]) & (f.tree.start[nodes[inside]] < f.tree.end[r])]
        if not len(inside):
            continue
        if compile_nodes[r]:
            search_acts[inside] = True
            continue
        last_sync = inside[g.a_kind[inside] == SYNC]
        if len(last_sync):
            search_acts[inside[inside <= last_sync[-1]]] = True
    e.cost_remove[search_acts] = g.cost[search_acts]
    e.no_wait[search_acts] = True
    e.drop_op[search_acts[g.o_action]] = True
    # host time inside the setup (between its calls), up to each search's last sync
    su = f.union_of_nodes(roots)
    gap_in = f.gap_time_in(su)
    e.gap_remove += np.where(search_acts, gap_in, 0.0)
    # what the shapes were
    kinds = "cuDNN algorithm search" if holder.any() else "torch.compile recompilation / autotuning"
    shapes = []
    if holder.any() and "input_dims" in f.rt.ops:
        rows = f.tree.row[holder & (f.tree.kind == OP)]
        dims = f.rt.ops.strings("input_dims")
        shapes = sorted({dims.labels[dims.codes[r]].split("], [")[0].lstrip("[") for r in rows})
    node = biggest_node(f, roots)
    site, stack = site_and_stack(f, node)
    name = f.tree.labels[f.tree.code[node]]
    setup_ns = float((f.tree.end[roots] - f.tree.start[roots]).sum())
    per = max(len(f.steps), 1)
    shape_txt = f" on {len(shapes)} different input shapes (e.g. {', '.join('[' + s + ']' for s in shapes[:3])})" if shapes else ""
    if holder.any():
        remedy = ("Keep input shapes from changing every step: pad or bucket them (e.g. round image sizes or "
                  "sequence lengths up to a few fixed sizes) so cuDNN's per-shape benchmark runs once per bucket; "
                  "if shapes can never repeat, set torch.backends.cudnn.benchmark = False.")
    else:
        remedy = ("Stop recompiling for every new shape: pad or bucket the varying dimension, or mark it dynamic "
                  "(torch._dynamo.mark_dynamic(x, dim) or torch.compile(dynamic=True)).")
    return [Cause(
        code=CODE, rank=f.rank,
        title=f"{kinds} runs again in {len(steps)} of {len(f.steps)} steps{shape_txt}: {ms(setup_ns / per)} per step in {name}",
        mechanism=("Plans are built and cached per input shape; when the shapes change every step the search "
                   "(each candidate run and timed with a device synchronisation) is repeated every step and the "
                   "GPU sits idle while the host times candidates."),
        remedy=remedy, place=Place("op" if holder.any() else "python", name, site, stack, steps),
        evidence={"setup_calls": int(roots.sum()), "setup_us": setup_ns / 1e3, "steps_with_setup": steps,
                  "shapes": shapes[:20], "distinct_shapes": len(shapes), "kind": kinds,
                  "search_actions": int(search_acts.sum()), "trial_ops": int(e.drop_op.sum())},
        edit=e, region=region, claims=idle_claim(f, region))]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect,
                    acts_on=("host: cuda sync", "host: op dispatch", "gpu: compute"))
