"""DECODE_LAUNCH_BOUND: decode iterations spend their time launching kernels, not running them.

Mechanism: a decode iteration runs the whole model for one token per sequence: hundreds of tiny
kernels, each with Python, dispatch and a launch on the host. With a small batch every kernel
finishes before the host has launched the next, so the GPU idles most of the iteration and the
token rate is set by the host. A CUDA graph replays the decode forward's launches with one call;
it needs static shapes, hence a static (pre-allocated) KV cache.

Evidence: decode iterations (analysis/serving.py) whose GPU is busy less than half of the time,
GPU idle inside their model forward. Fix priced: as LAUNCH_BOUND's CUDA graph, on the decode
iterations only (prefill runs once per request; LAUNCH_BOUND prices the rest).
"""
from __future__ import annotations

import numpy as np

from aiprof.diagnosis.causes import serving_common as sc
from aiprof.diagnosis.causes.common import ms
from aiprof.diagnosis.causes.launch_bound import graph_fix
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "DECODE_LAUNCH_BOUND"
# Decode iterations whose GPU is busy below this share of their time are host-bound.
MAX_GPU_BUSY_SHARE = 0.5


def remedy_for(engine: str) -> str:
    """The engine's own way to run decode from a CUDA graph."""
    if engine == sc.CB:
        return ("Turn on CUDA graphs in continuous batching: ContinuousBatchingConfig(use_cuda_graph=True) (the "
                "decode fast path is then replayed from a graph per padded batch size).")
    if engine == sc.VLLM:
        return ("Let vLLM capture CUDA graphs: drop enforce_eager=True (--enforce-eager) and make sure the batch "
                "sizes served are in cudagraph_capture_sizes.")
    if engine == sc.GENERATE:
        return ("Use a static KV cache and compile the decode step into CUDA graphs: "
                "model.generate(..., cache_implementation=\"static\") with model.forward = "
                "torch.compile(model.forward, mode=\"reduce-overhead\") (static shapes let the graph be replayed "
                "every token).")
    return ("Capture the decode forward once as a CUDA graph and replay it every token (torch.cuda.graphs, or "
            "torch.compile(mode=\"reduce-overhead\")); pre-allocate the KV cache so shapes are static.")


def detect(f: RankFacts) -> list[Cause]:
    dec = sc.gpu_decode_steps(f)
    if dec is None:
        return []
    g = f.graph
    sv = sc.serving(f)
    busy = sum(it.gpu_busy_us for it, m in zip(sv.iterations, dec) if m)
    dur = sum(it.duration_us for it, m in zip(sv.iterations, dec) if m)
    if dur <= 0 or busy / dur >= MAX_GPU_BUSY_SHARE:
        return []
    claimed = f.extra.get("claimed_nodes")
    claimed = claimed if claimed is not None and len(claimed) == len(f.tree) else np.zeros(len(f.tree), dtype=bool)
    fix = graph_fix(f, CODE, claimed, sc.nodes_in(f, dec), sc.actions_in(f, dec))
    if fix is None:
        return []
    e, acts, region, claims = fix
    n_dec = int(dec.sum())
    eng = sc.engine(f)
    in_window = dec & np.isin(f.steps.number, g.step_number)
    per_iter_launch = float(acts.sum()) / max(int(in_window.sum()), 1)
    kd = g.o_dur[acts[g.o_action]]
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"decode is launch-bound: {n_dec} decode iterations, the GPU busy {100 * busy / dur:.0f}% of them; "
               f"~{per_iter_launch:.0f} launches per iteration of kernels with a median {float(np.median(kd)) / 1e3:.1f} µs, "
               f"the GPU idle {ms(claims[0].us * 1e3 / n_dec)} per decode iteration"),
        mechanism=("Each decode iteration runs the whole model for one token per sequence: hundreds of tiny kernels, "
                   "each with Python, dispatch and a launch on the host; the GPU finishes each before the next is "
                   "launched, so the host sets the token rate."),
        remedy=remedy_for(eng), place=Place("step", "decode iterations", "", [], []),
        evidence={"decode_iterations": n_dec, "gpu_busy_share": busy / dur, "launches_per_iteration": per_iter_launch,
                  "median_kernel_us": float(np.median(kd)) / 1e3, "engine": eng},
        edit=e, region=region, claims=claims)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "steps", "tree"), detect=detect)
