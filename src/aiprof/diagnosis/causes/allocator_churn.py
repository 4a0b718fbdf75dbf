"""ALLOCATOR_CHURN: the caching allocator goes back to the driver every step.

Mechanism: PyTorch's caching allocator keeps freed blocks for reuse, so a steady training loop
calls ``cudaMalloc`` only while it warms up. When something returns the cache every step
(``torch.cuda.empty_cache()``), or fragmentation keeps the cache from fitting new requests, each
step pays ``cudaMalloc`` again, and every ``cudaFree`` first waits for the whole GPU to finish:
the host stalls, then the GPU idles while the host catches up.

Evidence: ``cudaMalloc``/``cudaFree`` calls in most analysed steps (not only the first one).
Fix priced: the calls, their waits and the ``empty_cache`` host time removed.
"""
from __future__ import annotations

from aiprof.analysis.hotspots import PYTHON, RUNTIME
from aiprof.diagnosis.causes.common import (
    biggest_node,
    idle_claim,
    ms,
    site_and_stack,
    steps_with,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "ALLOCATOR_CHURN"
_ALLOC = ("cudaMalloc", "cuMemAlloc", "cudaFree", "cuMemFree")
_EMPTY_CACHE = ("empty_cache", "_cuda_emptyCache")
# Allocations in at least this share of the steps make them a per-step cost, not warm-up.
RECURRING_SHARE = 0.5


def _is_alloc(name: str) -> bool:
    return name.startswith(_ALLOC) and not name.startswith(("cudaMallocHost", "cudaFreeHost", "cudaMallocAsync",
                                                               "cudaFreeAsync"))


def detect(f: RankFacts) -> list[Cause]:
    calls = f.node_mask(_is_alloc, (RUNTIME,))
    if not calls.any():
        return []
    steps = steps_with(f, calls)
    if len(steps) < max(1, RECURRING_SHARE * len(f.steps)) or (len(f.steps) > 1 and len(steps) < 2):
        return []
    empty = f.under(f.node_mask(lambda s: any(w in s for w in _EMPTY_CACHE), (PYTHON,)))
    region = f.under(calls) | empty
    acts = f.actions_in(calls)
    e = f.edit(CODE)
    e.cost_remove[acts] = f.graph.cost[acts]
    e.no_wait[acts] = True
    if empty.any():
        e.gap_remove += f.gap_time_in(f.union_of_nodes(empty))
    names = [f.tree.labels[c] for c in f.tree.code[calls]]
    n_malloc = sum(1 for s in names if "Malloc" in s or "Alloc" in s)
    n_free = len(names) - n_malloc
    host_ns = float((f.tree.end[calls] - f.tree.start[calls]).sum())
    per = max(len(f.steps), 1)
    if empty.any():
        node = biggest_node(f, empty & f.node_mask(lambda s: s.endswith("empty_cache"), (PYTHON,))) \
            if (empty & f.node_mask(lambda s: s.endswith("empty_cache"), (PYTHON,))).any() else biggest_node(f, empty)
        site, stack = site_and_stack(f, node)
        where = site or "your training loop"
        title = (f"torch.cuda.empty_cache() at {where} makes every step cudaFree and cudaMalloc again "
                 f"({n_free / per:.0f} frees, {n_malloc / per:.0f} mallocs per step)")
        remedy = (f"Remove torch.cuda.empty_cache() from {where}: the caching allocator then keeps its blocks and "
                  "the steady state allocates nothing from the driver. If it is there to fight out-of-memory "
                  "errors, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead.")
        place = Place("python", "torch.cuda.empty_cache", site, stack)
    else:
        node = biggest_node(f, calls)
        site, stack = site_and_stack(f, node)
        title = (f"the caching allocator calls cudaMalloc/cudaFree in {len(steps)} of {len(f.steps)} steps "
                 f"({n_malloc / per:.0f} mallocs, {n_free / per:.0f} frees per step, {ms(host_ns / per)} of host time)")
        remedy = ("Stop the allocator from returning to the driver every step: set "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation), keep tensor shapes stable "
                  "between steps, and do not call torch.cuda.empty_cache() in the loop.")
        place = Place("op", f.tree.labels[f.tree.code[f.tree.parent[node]]] if node >= 0 and f.tree.parent[node] >= 0 else
                      "cudaMalloc", site, stack)
    return [Cause(
        code=CODE, rank=f.rank, title=title,
        mechanism=("cudaFree waits for the whole GPU to finish before it returns, and cudaMalloc costs host time; "
                   "a warm caching allocator needs neither, so every call here is repeated work that drains the "
                   "GPU's queue."),
        remedy=remedy, place=place,
        evidence={"malloc_calls": n_malloc, "free_calls": n_free, "steps_with_calls": steps,
                  "host_us_in_calls": host_ns / 1e3, "empty_cache": bool(empty.any())},
        edit=e, region=region, claims=idle_claim(f, region))]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "steps", "tree"), detect=detect,
                    acts_on=("host: cuda runtime", "host: cuda sync"))
