"""KV_CACHE_COPY: the KV cache grows by concatenation, so every token copies the whole cache.

Mechanism: a dynamic KV cache appends each new token's keys and values with ``torch.cat``:
every decode iteration allocates new tensors and copies every cached position of every layer,
a cost that grows with the context (quadratic over a generation). A static or paged cache is
allocated once and writes only the new positions in place.

Evidence: ``aten::cat`` of two 4-D tensors [B, H, P, D] and [B, H, T, D] (the cached P
positions and T new ones, T < P) in the iterations, with the GPU time of their copy kernels.
Fix priced: each such copy kernel runs for T / (P + T) of its time (only the new positions are
written); the host's dispatch is unchanged (an in-place index copy is one op as well).
"""
from __future__ import annotations

import json

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.diagnosis.causes import serving_common as sc
from aiprof.diagnosis.causes.common import ms, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "KV_CACHE_COPY"


def _kv_ratio(label: str) -> float:
    """T / (P + T) for a cat of [B, H, P, D] and [B, H, T, D] with T < P; 0 otherwise."""
    try:
        d = json.loads(label) if label else None
    except ValueError:
        return 0.0
    if not (isinstance(d, list) and d and isinstance(d[0], list) and len(d[0]) == 2):
        return 0.0
    a, b = d[0]
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == 4 == len(b)):
        return 0.0
    if a[0] != b[0] or a[1] != b[1] or a[3] != b[3] or not (0 < b[2] < a[2]):
        return 0.0
    return b[2] / (a[2] + b[2])


def remedy_for(engine: str) -> str:
    if engine == sc.GENERATE:
        return ("Use a pre-allocated cache that is written in place: model.generate(..., cache_implementation=\"static\") "
                "(StaticCache), or serve with continuous batching's paged cache (model.generate_batch).")
    return ("Pre-allocate the KV cache (a static or paged cache) and write each new token's keys and values in place "
            "(index_copy_ into the slot) instead of concatenating.")


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    ops = f.rt.ops
    if sc.serving(f) is None or not len(f.tree) or not len(ops) or "input_dims" not in ops:
        return []
    tree = f.tree
    cat = f.node_mask(lambda s: s == "aten::cat", (OP,))
    if not cat.any():
        return []
    dims = ops.strings("input_dims")
    ratio_of = np.array([_kv_ratio(s) for s in dims.labels] + [0.0])
    ratio = np.zeros(len(tree))
    idx = np.nonzero(cat)[0]
    ratio[idx] = ratio_of[dims.codes[tree.row[idx]]]
    kv = ratio > 0
    if not kv.any():
        return []
    e = f.edit(CODE)
    anodes = f.action_nodes()
    op_node = np.full(g.n_actions, -1, np.int64)
    has = anodes >= 0
    op_node[has] = tree.nearest(anodes[has], OP)
    act_ratio = np.where(op_node >= 0, ratio[np.maximum(op_node, 0)], 0.0)
    hit = act_ratio[g.o_action] > 0 if g.n_ops else np.zeros(0, dtype=bool)
    e.op_dur[hit] = g.o_dur[hit] * act_ratio[g.o_action][hit]
    per = max(len(f.steps), 1)
    n_cat = int(kv.sum())
    gpu_ns = float(g.o_dur[hit].sum())
    node = int(idx[np.argmax(ratio[idx] > 0)])
    site, stack = site_and_stack(f, node)
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"the KV cache grows by torch.cat: {n_cat / per:.0f} concatenations per iteration copy every cached "
               f"position ({ms(gpu_ns / max(len(g.step_number), 1))} of GPU copies per iteration in the replayed ones)"),
        mechanism=("Each decode iteration concatenates the new keys and values to the cached ones: a fresh allocation "
                   "and a copy of the whole cache of every layer, growing with the context."),
        remedy=remedy_for(sc.engine(f)), place=Place("op", "aten::cat (KV cache)", site, stack),
        evidence={"concatenations": n_cat, "per_iteration": n_cat / per, "copy_kernels": int(hit.sum()),
                  "copy_gpu_us": gpu_ns / 1e3, "median_new_share": float(np.median(ratio[kv]))},
        edit=e)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "rt", "steps", "tree"), detect=detect)
