"""Iterations of a trace that has no step marker: the repeating unit of work, found automatically.

A serving engine's trace, an eager ``generate`` and a training loop profiled without a schedule
have no ``ProfilerStep`` and often no optimizer: their iterations are found from what repeats.
Rules, first that applies (docs/metrics.md, "Steps"):

1. **engine**: calls of a known serving engine's step function (transformers' continuous
   batching loop body, vLLM's engine step) — one call is one engine iteration;
2. **module**: forwards of the top-level ``nn.Module`` (Python frames ``nn.Module: Name_k``,
   recorded with stacks) that runs most, on the thread that runs most Python;
3. **ops**: the period of the sequence of top-level torch ops on the thread that runs most ops:
   the op whose occurrences cut that sequence into the most regular segments;
4. **kernels**: the same period search on the GPU's kernel sequence (a GPU-only export has no
   host events), each unit timed from the launch of its anchor kernel;
5. **gpu-bursts**: GPU work separated by idle gaps much longer than the usual gap between two
   kernels, each burst timed from the launch of its first kernel.

An iteration runs from the start of one unit to the start of the next, so a loop's whole time
(sampling, scheduling, the backward pass) is in some iteration. Units far apart (a gap much
longer than the usual gap: the engine was waiting for requests) end a run; the last unit of a
run keeps its usual tail after the unit, the window's last one everything up to the window's end
unless that is itself a long wait.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.launch import launch_ts
from aiprof.trace.store import RankTrace

# A rule needs at least this many units: two calls are a coincidence, not a loop.
MIN_UNITS = 3
# Serving engines' step functions, as Python frames 'path/file.py(N): function' (file suffix,
# function). Transformers 5.x continuous batching: one loop body is one scheduling + forward +
# update (verified on CPU traces); vLLM V1 EngineCore.step and V0/V1 LLMEngine.step (from source).
ENGINE_STEP_FRAMES = (
    ("generation/continuous_batching/continuous_api.py", "_generation_loop_body"),
    ("vllm/v1/engine/core.py", "step"),
    ("vllm/engine/llm_engine.py", "step"),
    ("vllm/v1/engine/llm_engine.py", "step"),
)
_MODULE_PREFIX = "nn.Module: "
# Two consecutive units belong to one run unless the gap between them exceeds this many times
# the median gap (and RUN_GAP_MIN_NS): beyond it the loop was waiting, not iterating.
RUN_GAP_FACTOR = 10.0
RUN_GAP_MIN_NS = 1_000_000
# Op-sequence rule: the modal segment must cover this share of the segments (a per-layer op
# cuts the sequence into layers, whose segment at the iteration boundary differs; an iteration
# anchor cuts it into identical iterations), and the anchors must span this share of the ops.
OPS_MIN_REGULAR = 0.6
OPS_MIN_SPAN = 0.5
# An op sequence shorter than this per segment is not an iteration (a view after every op).
OPS_MIN_SEGMENT = 4
# GPU-burst rule: a gap between kernels is a boundary when it is this many times the median
# gap between consecutive GPU ops and at least BURST_GAP_MIN_NS.
BURST_GAP_FACTOR = 20.0
BURST_GAP_MIN_NS = 200_000


@dataclass(frozen=True)
class Units:
    """Occurrences of the repeating unit (host clock, ns) and the rule that found them."""

    start: np.ndarray
    end: np.ndarray
    source: str  # "engine:<function>", "module:<name>", "ops:<op>", "kernels:<kernel>", "gpu-bursts"

    def __len__(self) -> int:
        return len(self.start)


def _busiest_tid(t) -> int:
    vals, counts = npx.unique(t["tid"], return_counts=True)
    return int(vals[np.argmax(counts)])


def _outermost(ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Indices (into time-sorted arrays) of intervals not nested in an earlier one."""
    if not len(ts):
        return np.zeros(0, np.int64)
    reach = np.maximum.accumulate(end)
    prev = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    return np.nonzero(ts >= prev)[0]


def _frame_function(label: str) -> tuple[str, str]:
    head, _, fn = label.partition("): ")
    return head.rsplit("(", 1)[0], fn


def engine_units(rt: RankTrace) -> Units | None:
    """Calls of a known engine step function (outermost, on the thread that makes most)."""
    py = rt.python
    if not len(py):
        return None
    names = py.strings("name")
    hit = {}
    for i, s in enumerate(names.labels):
        path, fn = _frame_function(s)
        for suffix, func in ENGINE_STEP_FRAMES:
            if fn == func and path.endswith(suffix):
                hit[i] = f"{suffix.rsplit('/', 1)[-1][:-3]}.{func}"
    if not hit:
        return None
    m = np.isin(names.codes, list(hit))
    tid = _busiest_tid(py.take(np.nonzero(m)[0]))
    m &= py["tid"] == tid
    ts, end = py["ts"][m], (py["ts"] + py["dur"])[m]
    code = names.codes[m]
    order = np.argsort(ts, kind="stable")
    keep = order[_outermost(ts[order], end[order])]
    if len(keep) < MIN_UNITS:
        return None
    src = hit[int(np.bincount(code[keep]).argmax())]
    return Units(ts[keep], end[keep], f"engine:{src}")


def module_units(rt: RankTrace) -> Units | None:
    """Forwards of the top-level nn.Module that takes most time, on the busiest Python thread."""
    py = rt.python
    if not len(py):
        return None
    names = py.strings("name")
    mod = names.isin_labels(lambda s: s.startswith(_MODULE_PREFIX))
    if not mod.any():
        return None
    tid = _busiest_tid(py.take(np.nonzero(mod)[0]))
    sel = np.nonzero(mod & (py["tid"] == tid))[0]
    ts, end, code = py["ts"][sel], (py["ts"] + py["dur"])[sel], names.codes[sel]
    order = np.argsort(ts, kind="stable")
    top = order[_outermost(ts[order], end[order])]
    codes, counts = npx.unique(code[top], return_counts=True)
    ok = counts >= MIN_UNITS
    if not ok.any():
        return None
    total = np.array([(end[top] - ts[top])[code[top] == c].sum() for c in codes])
    best = int(codes[ok][np.argmax(total[ok])])
    k = top[code[top] == best]
    k = k[np.argsort(ts[k], kind="stable")]
    return Units(ts[k], end[k], f"module:{names.labels[best][len(_MODULE_PREFIX):]}")


def _period_anchor(code: np.ndarray) -> np.ndarray | None:
    """Positions of the anchor that cuts the name sequence ``code`` into iterations, or None.

    A candidate anchor is a name whose occurrences cut the sequence into regular segments (see
    OPS_MIN_*). The coarsest one (fewest occurrences) is a whole iteration or a multiple of it
    (a name seen every 4th token); a per-layer name also cuts regular segments, but finer ones
    that do not add up to the iteration (the embedding and the LM head are outside every layer).
    So the anchor kept is the finest candidate whose usual segment, repeated, makes exactly the
    coarsest one's; among equal counts the one that comes first starts the iteration."""
    n = len(code)
    if n < MIN_UNITS * OPS_MIN_SEGMENT:
        return None
    # segment signatures: (length, sum of a random weight per name), from prefix sums
    rng = np.random.default_rng(0)
    w = rng.integers(1, 2**40, size=int(code.max()) + 1)
    pref = np.concatenate([[0], np.cumsum(w[code])])
    # positions of every name, grouped (one sort), so each candidate costs its own count
    by_code = np.argsort(code, kind="stable")
    _, first, counts = np.unique(code[by_code], return_index=True, return_counts=True)
    regular = []  # (count, first position, positions, usual segment's (length, weight))
    for k in np.nonzero((counts >= MIN_UNITS) & (n / np.maximum(counts, 1) >= OPS_MIN_SEGMENT))[0]:
        cnt = int(counts[k])
        pos = by_code[first[k]:first[k] + cnt]
        if (pos[-1] - pos[0]) < OPS_MIN_SPAN * n:
            continue
        sig = np.stack([np.diff(pos), pref[pos[1:]] - pref[pos[:-1]]])
        vals, cts = np.unique(sig, axis=1, return_counts=True)
        if cts.max() < OPS_MIN_REGULAR * sig.shape[1]:
            continue
        usual = vals[:, int(np.argmax(cts))]
        regular.append((cnt, int(pos[0]), pos, (int(usual[0]), int(usual[1]))))
    if not regular:
        return None
    _, _, _, (length, weight) = min(regular, key=lambda r: (r[0], r[1]))
    tiles = [r for r in regular if length % r[3][0] == 0 and r[3][1] * (length // r[3][0]) == weight]
    # the shortest usual segment that tiles; of the anchors with it, the one with fewest stray
    # occurrences (an op also used once in the set-up cuts the same iterations plus one)
    return min(tiles, key=lambda r: (r[3][0], r[0], r[1]))[2]


def op_units(rt: RankTrace) -> Units | None:
    """The period of the top-level op sequence on the thread that runs most ops."""
    ops = rt.ops
    if len(ops) < MIN_UNITS * OPS_MIN_SEGMENT:
        return None
    tid = _busiest_tid(ops)
    sel = np.nonzero(ops["tid"] == tid)[0]
    ts, end = ops["ts"][sel], (ops["ts"] + ops["dur"])[sel]
    order = np.argsort(ts, kind="stable")
    top = order[_outermost(ts[order], end[order])]
    names = ops.strings("name")
    pos = _period_anchor(names.codes[sel][top].astype(np.int64))
    if pos is None:
        return None
    anchor = names.labels[names.codes[sel][top][pos[0]]]
    return Units(ts[top][pos], end[top][pos], f"ops:{anchor}")


def kernel_units(rt: RankTrace) -> Units | None:
    """The period of the GPU's kernel sequence (all streams, by start time), each unit timed from
    the launch of its anchor kernel: for a GPU-only export, which has no host events."""
    k = rt.kernels
    if len(k) < MIN_UNITS * OPS_MIN_SEGMENT:
        return None
    order = np.argsort(k["ts"], kind="stable")
    names = k.strings("name")
    pos = _period_anchor(names.codes[order].astype(np.int64))
    if pos is None:
        return None
    start = launch_ts(rt.runtime, k.take(order))[pos]
    nxt = np.concatenate([start[1:], [start[-1] + 1]])
    anchor = names.labels[names.codes[order][pos[0]]]
    return Units(start.astype(np.int64), np.maximum(nxt, start + 1).astype(np.int64), f"kernels:{anchor}")


def gpu_burst_units(rt: RankTrace) -> Units | None:
    """Bursts of GPU work separated by long idle gaps, on the host clock of their first launch."""
    k = rt.kernels
    if len(k) < MIN_UNITS * 2:
        return None
    order = np.argsort(k["ts"], kind="stable")
    s, e = k["ts"][order], (k["ts"] + k["dur"])[order]
    reach = np.maximum.accumulate(e)
    gaps = s[1:] - reach[:-1]
    pos = gaps[gaps > 0]
    if not len(pos):
        return None
    thr = max(BURST_GAP_FACTOR * float(np.median(pos)), BURST_GAP_MIN_NS)
    cut = np.nonzero(gaps > thr)[0] + 1
    first = np.concatenate([[0], cut])
    if len(first) < MIN_UNITS:
        return None
    last = np.concatenate([cut - 1, [len(s) - 1]])
    start = launch_ts(rt.runtime, k.take(order))[first]
    end = np.maximum(reach[last], start + 1)
    return Units(start.astype(np.int64), end.astype(np.int64), "gpu-bursts")


def find_units(rt: RankTrace, rules: tuple[str, ...] = ("engine", "module", "ops", "kernels", "gpu")) -> Units | None:
    """The repeating unit by the first rule (of ``rules``) that finds one."""
    fns = {"engine": engine_units, "module": module_units, "ops": op_units, "kernels": kernel_units,
           "gpu": gpu_burst_units}
    for r in rules:
        u = fns[r](rt)
        if u is not None and len(u) >= MIN_UNITS:
            return u
    return None


def has_backward(rt: RankTrace) -> bool:
    """True when the trace has autograd's backward pass (a training loop, not inference)."""
    ops = rt.ops
    if not len(ops):
        return False
    return bool(ops.strings("name").isin_labels(
        lambda s: s.startswith("autograd::engine::evaluate_function") or "Backward" in s).any())


def iteration_windows(u: Units, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Iterations [start, end) from units inside [lo, hi): each from its unit's start to the next
    unit's start; a run ends at a long gap, and its last unit keeps the usual tail."""
    m = (u.start >= lo) & (u.start < hi)
    s, e = u.start[m], np.minimum(u.end[m], hi)
    if not len(s):
        return s, e
    nxt = np.concatenate([s[1:], [hi]])
    gap = np.maximum(nxt - e, 0)[:-1]
    med_gap = float(np.median(gap)) if len(gap) else 0.0
    brk = np.zeros(len(s), dtype=bool)
    if len(gap):
        brk[:-1] = gap > max(RUN_GAP_FACTOR * med_gap, RUN_GAP_MIN_NS)
    brk[-1] = True
    tail = float(np.median(gap[~brk[:-1]])) if len(gap) and (~brk[:-1]).any() else 0.0
    end = np.where(brk, np.minimum(e + int(tail), nxt), nxt)
    # the window's last unit keeps everything up to the window's end unless that is a long wait
    # (a training loop's last backward pass, the last token's sampling before generate returns)
    if hi - e[-1] <= max(RUN_GAP_FACTOR * tail, RUN_GAP_MIN_NS):
        end[-1] = hi
    return s, np.maximum(end, s + 1)
