"""UNFUSED_OPTIMIZER: the optimizer updates its parameters one tensor at a time.

Mechanism: ``torch.optim`` with ``foreach=False`` (or an optimizer without a multi-tensor
path) launches about ten small kernels per parameter tensor each step, each paying op dispatch
and a launch on the host while the GPU finishes each in microseconds. The fused/foreach
implementations do the same arithmetic in one kernel per group of tensors.

Evidence: the optimizer's step (``torch/optim/*: step`` frames or the ``Optimizer.step#``
annotation) launches many kernels and no ``_foreach_``/``_fused_`` op. Fix priced: the region's
host time replaced by the launches a fused optimizer makes, its kernels by as many kernels
doing the same memory traffic (each kernel's time above the smallest one's is data movement, the
smallest is the fixed cost a fused kernel pays once).
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

from aiprof.analysis.hotspots import ANNOTATION, OP, PYTHON
from aiprof.diagnosis.causes.common import (
    biggest_node,
    idle_claim,
    ms,
    outermost,
    site_and_stack,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import LAUNCH
from aiprof.diagnosis.model import Cause, Place

CODE = "UNFUSED_OPTIMIZER"
_STEP_FRAME = re.compile(r"torch/optim/[\w/]+\.py\(\d+\): step$")
_FUSED_OPS = ("aten::_foreach_", "aten::_fused_")
# Fewer kernels than this per optimizer step is not a per-tensor loop worth fusing.
MIN_KERNELS_PER_STEP = 64
# Tensors one multi-tensor-apply launch handles for Adam's four lists (PyTorch
# aten/src/ATen/native/cuda/MultiTensorApply.cuh: depth_to_max_tensors[3] == 36).
TENSORS_PER_FUSED_LAUNCH = 36
# The per-parameter op of the common optimizers: one call per tensor per step.
_PER_TENSOR_OPS = ("aten::addcdiv_", "aten::lerp_", "aten::addcmul_", "aten::sqrt", "aten::add_")
# Bytes a fused step moves per parameter element, in units of the element size: Adam/AdamW read
# param, grad, exp_avg, exp_avg_sq and write param, exp_avg, exp_avg_sq; SGD with momentum reads
# param, grad, buffer and writes param, buffer.
FUSED_TRAFFIC = {"adam": 7, "sgd": 5}
# Kernels over at least this many elements are bandwidth-bound: their bytes/duration is the
# bandwidth the fused kernel will get on this GPU.
BW_SAMPLE_MIN_NUMEL = 1 << 18
_ESIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4}


def _tensors(dims: str, types: str) -> list[tuple[int, int]]:
    """(numel, element size) of each tensor input of an op, from its recorded shapes and types."""
    try:
        d = json.loads(dims) if dims else []
        t = json.loads(types) if types else []
    except ValueError:
        return []
    out = []
    for shape, ty in zip(d, t):
        if isinstance(shape, list) and shape and ty in _ESIZE:
            out.append((int(np.prod(shape)), _ESIZE[ty]))
    return out


def _traffic(f: RankFacts, region: np.ndarray, per_tensor_op: str) -> tuple[float, int, float]:
    """Parameter elements updated per step, their element size, and the bandwidth (bytes/ns)
    the region's bandwidth-bound kernels achieved (0 when the trace has no shapes)."""
    o = f.rt.ops
    if not len(o) or "input_dims" not in o:
        return 0.0, 4, 0.0
    g = f.graph
    dims, types = o.strings("input_dims"), o.strings("input_types")
    op_nodes = np.nonzero(region & (f.tree.kind == OP))[0]
    rows = f.tree.row[op_nodes]
    names = [f.tree.labels[c] for c in f.tree.code[op_nodes]]
    numel, esize = 0.0, 4
    per_op_bytes: dict[int, float] = {}
    for node, row, name in zip(op_nodes, rows, names):
        ts = _tensors(dims.labels[dims.codes[row]], types.labels[types.codes[row]])
        if not ts:
            continue
        if name == per_tensor_op:
            numel += ts[0][0]
            esize = ts[0][1]
        if ts[0][0] >= BW_SAMPLE_MIN_NUMEL:  # in-place or not, the first operand's size is written
            per_op_bytes[int(node)] = sum(n * b for n, b in ts) + ts[0][0] * ts[0][1]
    bw = 0.0
    if per_op_bytes:
        # kernels launched under each sampled op (its runtime calls' ops)
        anodes = f.action_nodes()
        op_of_action = f.tree.nearest(np.maximum(anodes, 0), OP)
        op_of_action[anodes < 0] = -1
        k_op = op_of_action[g.o_action]
        sel = np.isin(k_op, list(per_op_bytes))
        if sel.any():
            total_b = sum(per_op_bytes[int(n)] for n in np.unique(k_op[sel]))
            bw = total_b / float(g.o_dur[sel].sum())
    return numel / max(len(f.steps), 1), esize, bw


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    roots = f.node_mask(lambda s: bool(_STEP_FRAME.search(s)), (PYTHON,)) | \
        f.node_mask(lambda s: s.startswith("Optimizer.step#"), (ANNOTATION,))
    if not roots.any():
        return []
    region = f.under(roots)
    fused = region & f.node_mask(lambda s: s.startswith(_FUSED_OPS), (OP,))
    if fused.any():
        return []
    acts = f.actions_in(region)
    ops_in = acts[g.o_action] if g.n_ops else np.zeros(0, dtype=bool)
    per = max(len(f.steps), 1)
    n_k = int(ops_in.sum())
    if n_k / per < MIN_KERNELS_PER_STEP:
        return []
    # tensors: calls of the per-parameter op that occurs most
    # the first of the per-tensor ops (in the order above: once per tensor in Adam/SGD) that occurs
    per_tensor_op, n_calls = "", 0
    for op in _PER_TENSOR_OPS:
        n_calls = int((region & f.node_mask(lambda s, o=op: s == o, (OP,))).sum())
        if n_calls:
            per_tensor_op = op
            break
    tensors = max(1, round(n_calls / per)) if n_calls else max(1, round(n_k / per / 10))
    launches = math.ceil(tensors / TENSORS_PER_FUSED_LAUNCH)
    e = f.edit(CODE)
    # the GPU side: a fused kernel moves each element's state once, at the bandwidth the
    # region's large elementwise kernels reached on this GPU
    dur = g.o_dur[ops_in]
    fixed = float(np.percentile(dur, 5)) if len(dur) else 0.0
    opt_kind = "sgd" if any("sgd" in f.tree.labels[c].lower() for c in f.tree.code[roots]) else "adam"
    numel_step, esize, bw = _traffic(f, region, per_tensor_op)
    fused_gpu = numel_step * esize * FUSED_TRAFFIC[opt_kind] / bw if bw > 0 else float(
        np.maximum(dur - fixed, 0).sum() / per)
    calls = np.nonzero(outermost(f, roots))[0]
    region_union = f.union_of_nodes(roots)
    gap_in = f.gap_time_in(region_union)
    act_idx = np.nonzero(acts)[0]
    # per optimizer call: keep `launches` launch actions (their host cost), drop the other calls'
    # cost and the host time between them; the kept ops do the whole update
    starts = np.sort(f.tree.start[calls])
    call_of = np.searchsorted(starts, g.a_ts[act_idx], side="right") - 1
    n_calls = max(len(np.unique(call_of)), 1)
    for c in np.unique(call_of):
        a = act_idx[call_of == c]
        la = a[g.a_kind[a] == LAUNCH]
        keep = la[:launches]
        drop = np.setdiff1d(a, keep)
        e.cost_remove[drop] = g.cost[drop]
        e.gap_remove[a] += gap_in[a]
        e.gap_remove[keep] -= gap_in[keep]
        ops = np.nonzero(np.isin(g.o_action, a))[0]
        if not len(ops):
            continue
        kept_ops = np.nonzero(np.isin(g.o_action, keep))[0][:launches]
        e.drop_op[ops] = True
        e.drop_op[kept_ops] = False
        if len(kept_ops):
            e.op_dur[kept_ops] = fixed + fused_gpu * per / n_calls / len(kept_ops)
    node = biggest_node(f, roots)
    site, stack = site_and_stack(f, node)
    ann = [f.tree.labels[c] for c in f.tree.code[roots & (f.tree.kind == ANNOTATION)]]
    opt = ann[0].split("#", 1)[1].split(".", 1)[0] if ann else "the optimizer"
    host_ns = float((f.tree.end[roots] - f.tree.start[roots]).sum())
    name = opt if opt != "the optimizer" else "torch.optim optimizer"
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{name}.step updates ~{tensors} parameter tensors one at a time: {n_k / per:.0f} kernels and "
               f"{ms(host_ns / per)} of host time per step"),
        mechanism=("A for-loop optimizer dispatches and launches about ten tiny kernels per tensor; the GPU runs "
                   "each in microseconds and then waits for the host to launch the next."),
        remedy=(f"Use the fused implementation: {opt if opt != 'the optimizer' else 'the optimizer'}(..., fused=True) "
                "(or foreach=True where fused is not available); it updates all tensors in "
                f"~{launches} kernel launch(es) per step."),
        place=Place("optimizer", f"{name}.step", site, stack),
        evidence={"kernels_per_step": n_k / per, "tensors": tensors, "per_tensor_op": per_tensor_op,
                  "fused_launches": launches, "host_us_per_step": host_ns / per / 1e3,
                  "fixed_kernel_us": fixed / 1e3, "fused_gpu_us_per_step": fused_gpu / 1e3,
                  "bandwidth_gbps": bw, "elements": numel_step},
        edit=e, region=region, claims=idle_claim(f, region))]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect,
                    acts_on=("host: op dispatch", "host: cuda runtime"))
