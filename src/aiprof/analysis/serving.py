"""Serving semantics of each iteration of an inference trace: phase, batch, tokens, tokens/s.

Definitions in docs/metrics.md ("Serving"). An inference trace (no backward pass) whose
iterations run a language model's forward (a token ``aten::embedding``) is read as serving:

* **tokens in** — query tokens the forward processed: the token embedding's index count (padding
  included in a padded batch; a packed batch is ``[1, total tokens]``);
* **tokens out** — tokens generated: the rows of the sampling op (argmax, multinomial, top-k,
  softmax over the vocabulary), else of the LM head (the linear whose weight is the vocabulary's);
  one per sequence that samples in this iteration, so also the **batch size**;
* **phase** — from the engine's own annotations when present (a host annotation naming prefill or
  decode), else from shapes: ``decode`` when every sequence processes one token (tokens in =
  tokens out, or a padded batch [B, 1]); ``prefill`` when every sequence processes several (a
  padded batch with more than one position, a single sequence, or attention that reads no cached
  keys); ``mixed`` otherwise (a packed batch with more tokens than sequences and cached keys:
  prompts beside decodes); ``idle`` when the iteration runs no forward (an engine waiting for
  requests); ``unknown`` without shapes.

Needs ``record_shapes`` (``--what shapes``); with Python stacks the model forward's host time is
known too (host overhead = the iteration outside the forward: scheduling, sampling, bookkeeping).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from aiprof.analysis.breakdown import StepBreakdown
from aiprof.analysis.intervals import union
from aiprof.analysis.iterations import has_backward, module_units
from aiprof.analysis.steps import Steps, window
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
PREFILL, DECODE, MIXED, IDLE, UNKNOWN = "prefill", "decode", "mixed", "idle", "unknown"
PHASES = (PREFILL, DECODE, MIXED, IDLE, UNKNOWN)
_SAMPLING_OPS = ("aten::argmax", "aten::multinomial", "aten::topk", "aten::softmax", "aten::sort", "aten::_softmax")
_ATTENTION_OPS = ("aten::scaled_dot_product_attention",)
# The iteration-time histogram has this many bins (shared by all phases so they stack).
HIST_BINS = 20
# Why the report has no whole-run tokens/s beside the window's (docs/metrics.md "Serving"): the agent
# times and counts the iterations outside the captured window, never their tokens.
WHOLE_RUN_AGENT = ("the aiprof agent counted {seen} iterations of the run but no tokens outside the captured "
                   "window: this rate is the window's, not the run's")
WHOLE_RUN_NO_AGENT = ("no aiprof agent record of the run beside this trace: this rate is the captured window's, "
                      "not the run's")
# tokens/s over time: the window is cut into at most this many bins.
THROUGHPUT_BINS = 40


@dataclass
class ServingIteration:
    """One iteration of the serving loop (times in µs)."""

    step: int
    start_ns: int
    duration_us: float
    phase: str
    phase_from: str  # "annotation" | "shapes" | "" (idle/unknown)
    tokens_in: int  # query tokens processed (-1: unknown)
    tokens_out: int  # tokens generated = sequences that sampled (-1: unknown)
    kv_tokens: int  # keys the first attention read per sequence (-1: unknown)
    forward_us: float  # host time inside the model's top-level forward (-1: unknown, no stacks)
    host_overhead_us: float  # the rest of the iteration (-1: unknown)
    gpu_busy_us: float


@dataclass
class ServingAnalysis:
    model: str  # top-level module, when stacks were recorded
    vocab: int
    shapes: bool  # input shapes were recorded (tokens and phases known)
    iterations: list[ServingIteration]
    summary: dict = field(default_factory=dict)


def _dims(labels: list[str]) -> list[list | None]:
    out: list[list | None] = []
    for s in labels:
        try:
            v = json.loads(s) if s else None
        except ValueError:
            v = None
        out.append(v if isinstance(v, list) else None)
    return out


def _prod(shape) -> int:
    if not isinstance(shape, list) or not shape or not all(isinstance(x, int) for x in shape):
        return -1
    return int(np.prod(shape))


def _first_in(idx: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """Per iteration (0..n-1): the first of ``rows`` (time-sorted) in it, or -1."""
    out = np.full(n, -1, np.int64)
    ok = idx >= 0
    r, i = rows[ok], idx[ok]
    if len(r):
        first = np.unique(i, return_index=True)
        out[first[0]] = r[first[1]]
    return out


def serving_analysis(rt: RankTrace, steps: Steps, breakdown: list[StepBreakdown]) -> ServingAnalysis | None:
    """The serving view of an inference trace's iterations; None for training or non-LM traces."""
    ops = rt.ops
    if not len(ops) or not len(steps) or has_backward(rt):
        return None
    names = ops.strings("name")
    emb = names.isin_labels(lambda s: s == "aten::embedding")
    if not emb.any():
        return None
    n = len(steps)
    has_dims = "input_dims" in ops
    dims_s = ops.strings("input_dims") if has_dims else None
    parsed = _dims(dims_s.labels) if has_dims else []

    def dims(r: int):
        return parsed[dims_s.codes[r]] if has_dims and r >= 0 else None

    # the vocabulary: the largest embedding table
    emb_rows = np.nonzero(emb)[0]
    vocab = -1
    for c in np.unique(dims_s.codes[emb_rows]) if has_dims else []:
        d = parsed[c]
        if d and isinstance(d[0], list) and len(d[0]) == 2:
            vocab = max(vocab, int(d[0][0]))
    shapes = vocab > 0
    tok_emb = np.array([bool(shapes and (d := dims(r)) and d[0] and d[0][0] == vocab) for r in emb_rows], dtype=bool)
    emb_rows = emb_rows[tok_emb] if shapes else emb_rows
    idx_all = steps.index_of(ops["ts"])
    # tokens in: all token-embedding lookups of the iteration (one per forward)
    tokens_in = np.zeros(n, np.int64)
    fwd = np.zeros(n, np.int64)
    batch_dim = np.full(n, -1, np.int64)
    for r in emb_rows:
        i = idx_all[r]
        if i < 0:
            continue
        fwd[i] += 1
        d = dims(r)
        t = _prod(d[1]) if d and len(d) > 1 else -1
        tokens_in[i] = tokens_in[i] + t if t >= 0 and tokens_in[i] >= 0 else -1
        if d and len(d) > 1 and isinstance(d[1], list) and len(d[1]) == 2 and batch_dim[i] < 0:
            batch_dim[i] = d[1][0]
    if not shapes:
        tokens_in[:] = -1
    # tokens out: LM-head rows, else sampling rows
    tokens_out = np.full(n, -1, np.int64)
    if shapes:
        lin = np.nonzero(names.isin_labels(lambda s: s in ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm")))[0]
        head = [r for r in lin if (d := dims(r)) and len(d) > 1 and isinstance(d[1], list) and len(d[1]) == 2
                and vocab in d[1] and isinstance(d[0], list) and d[0]]
        samp = [r for r in np.nonzero(names.isin_labels(lambda s: s in _SAMPLING_OPS))[0]
                if (d := dims(r)) and isinstance(d[0], list) and len(d[0]) >= 2 and d[0][-1] == vocab]
        # the sampling op's rows where it is seen (one per sequence), else the LM head's: a
        # [B, T, H] input with B > 1 is a padded batch that samples B tokens (a forward without
        # logits_to_keep computes all T positions), a packed [1, N, H] one row per sequence
        for rows, is_head in ((samp, False), (head, True)):
            for r in rows:
                i = idx_all[r]
                if i >= 0 and tokens_out[i] < 0:
                    lead = dims(r)[0][:-1]
                    k = lead[0] if is_head and len(lead) == 2 and isinstance(lead[0], int) and lead[0] > 1 else _prod(lead)
                    tokens_out[i] = k if k > 0 else -1
    # attention: keys read vs queries (cached context or not)
    kv = np.full(n, -1, np.int64)
    tq = np.full(n, -1, np.int64)
    if shapes:
        att = np.nonzero(names.isin_labels(lambda s: s in _ATTENTION_OPS))[0]
        first = _first_in(idx_all[att], att, n)
        for i, r in enumerate(first):
            d = dims(int(r)) if r >= 0 else None
            if d and len(d) > 1 and isinstance(d[0], list) and isinstance(d[1], list) and len(d[0]) == 4 == len(d[1]):
                tq[i], kv[i] = d[0][-2], d[1][-2]
    # the engine's own phase annotations
    ann_phase = [""] * n
    a = rt.annotations
    if len(a):
        an = a.strings("name")
        tag = {}
        for c, s in enumerate(an.labels):
            low = s.lower()
            if "prefill" in low and "decode" not in low:
                tag[c] = PREFILL
            elif "decode" in low and "prefill" not in low:
                tag[c] = DECODE
        if tag:
            ai = steps.index_of(a["ts"])
            for r in np.nonzero(~a["gpu"] & np.isin(an.codes, list(tag)) & (ai >= 0))[0]:
                p = tag[int(an.codes[r])]
                i = ai[r]
                ann_phase[i] = p if ann_phase[i] in ("", p) else MIXED
    # host time inside the model's top-level forward
    mu = module_units(rt)
    fwd_us = np.full(n, -1.0)
    if mu is not None:
        u = union(mu.start, mu.end)
        fwd_us = u.covered(steps.start, steps.end).astype(np.float64) / NS_PER_US
    iters = []
    for i in range(n):
        dur = float(steps.end[i] - steps.start[i]) / NS_PER_US
        b = breakdown[i] if i < len(breakdown) else None
        busy = (b.duration_us - b.idle_us) if b is not None else 0.0
        if fwd[i] == 0 and (mu is None or fwd_us[i] <= 0):
            phase, src = IDLE, ""
        elif ann_phase[i]:
            phase, src = ann_phase[i], "annotation"
        elif not shapes or tokens_in[i] < 0:
            phase, src = UNKNOWN, ""
        else:
            phase, src = _phase(int(tokens_in[i]), int(tokens_out[i]), int(batch_dim[i]), int(tq[i]), int(kv[i])), "shapes"
        f = float(fwd_us[i])
        iters.append(ServingIteration(
            step=int(steps.number[i]), start_ns=int(steps.start[i]), duration_us=dur, phase=phase, phase_from=src,
            tokens_in=int(tokens_in[i]) if phase != IDLE else 0, tokens_out=int(tokens_out[i]) if phase != IDLE else 0,
            kv_tokens=int(kv[i]), forward_us=f, host_overhead_us=max(dur - f, 0.0) if f >= 0 else -1.0,
            gpu_busy_us=float(busy)))
    model = mu.source.split(":", 1)[1] if mu is not None else ""
    out = ServingAnalysis(model=model, vocab=int(vocab), shapes=bool(shapes), iterations=iters)
    out.summary = summarize(iters, rt_has_gpu=bool(len(rt.kernels)))
    if out.summary:
        out.summary["interval"] = rate_interval(rt, out.summary["interval"])
    return out


def rate_interval(rt: RankTrace, iv: dict) -> dict:
    """The interval tokens/s covers: the model's iterations inside the captured window, placed in
    the capture (offsets from its first event, wall-clock times where the agent aligned the
    clocks), and the whole run's rate where something saw it (else null, with why)."""
    lo, hi = window(rt)
    # the capture holds its iterations (a step window may end a nanosecond past the last event)
    lo, hi = min(lo, iv["start_ns"]), max(hi, iv["end_ns"])
    agent = rt.meta.get("capture") or {}
    clock = agent.get("clock") or {}
    seen = (agent.get("steps") or {}).get("seen_total")
    off = clock.get("trace_minus_unix_us")
    out = dict(iv, covers="captured window", capture_duration_us=(hi - lo) / NS_PER_US,
               from_capture_start_us=(iv["start_ns"] - lo) / NS_PER_US,
               to_capture_start_us=(iv["end_ns"] - lo) / NS_PER_US,
               start_unix_ns=int(iv["start_ns"] - off * NS_PER_US) if off is not None else None,
               end_unix_ns=int(iv["end_ns"] - off * NS_PER_US) if off is not None else None,
               whole_run_tokens_per_s=None,
               whole_run_reason=WHOLE_RUN_AGENT.format(seen=seen) if seen is not None else WHOLE_RUN_NO_AGENT)
    return out


def _phase(tin: int, tout: int, batch: int, tq: int, kv: int) -> str:
    """Phase from shapes (see the module docstring)."""
    if batch > 1:  # a padded batch [B, T]: one position each is decoding, more is the prompt
        return DECODE if tin == batch else PREFILL
    if tout > 0 and tin == tout:
        return DECODE
    if tout <= 1:
        return PREFILL
    if tq > 0 and kv == tq:  # attention reads no cached keys: every sequence is new
        return PREFILL
    return MIXED


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else 0.0


def _interval(iters: list[ServingIteration], busy: np.ndarray, span_us: float) -> dict:
    """The span tokens/s covers, in exact integer ns (float64 loses nanoseconds at epoch-scale
    trace clocks): first start to last end of the model's iterations (of all, when none ran it)."""
    its = [x for x, b in zip(iters, busy) if b] or iters
    return {"start_ns": min(x.start_ns for x in its),
            "end_ns": max(x.start_ns + round(x.duration_us * NS_PER_US) for x in its), "duration_us": span_us}


def summarize(iters: list[ServingIteration], rt_has_gpu: bool = True) -> dict:
    """Totals, tokens/s, per-phase shares, inter-token gaps, and the distributions the UI draws."""
    if not iters:
        return {}
    dur = np.array([x.duration_us for x in iters])
    start = np.array([x.start_ns for x in iters], dtype=np.float64)
    phase = np.array([x.phase for x in iters])
    tout = np.array([max(x.tokens_out, 0) for x in iters])
    tin = np.array([max(x.tokens_in, 0) for x in iters])
    busy_it = phase != IDLE
    t0 = start[busy_it].min() if busy_it.any() else start.min()
    t1 = (start + dur * NS_PER_US)[busy_it].max() if busy_it.any() else (start + dur * NS_PER_US).max()
    span_us = max(float(t1 - t0) / NS_PER_US, 1e-9)
    total = float(dur.sum())
    by_phase = {}
    for p in PHASES:
        m = phase == p
        if not m.any():
            continue
        by_phase[p] = {"iterations": int(m.sum()), "time_us": float(dur[m].sum()),
                       "share": float(dur[m].sum() / total) if total > 0 else 0.0,
                       "median_us": float(np.median(dur[m])), "p90_us": _pct(dur[m], 90),
                       "tokens_in": int(tin[m].sum()), "tokens_out": int(tout[m].sum())}
    # inter-token gaps: from one token-producing iteration's end to the next one's end, in a row
    # of decode/mixed iterations (a prefill-only iteration between them delays every running
    # sequence's next token)
    ends = start + dur * NS_PER_US
    prod = np.isin(phase, (DECODE, MIXED))
    pe = ends[prod]
    itl = np.diff(pe) / NS_PER_US if len(pe) >= 2 else np.zeros(0)
    batch = tout[prod | (phase == PREFILL)]
    batch = batch[batch > 0]
    vals, counts = np.unique(batch, return_counts=True) if len(batch) else (np.zeros(0, int), np.zeros(0, int))
    edges = np.histogram_bin_edges(dur, bins=HIST_BINS) if len(dur) else np.zeros(0)
    hist = {p: np.histogram(dur[phase == p], bins=edges)[0].tolist() for p in by_phase}
    # tokens/s over time: tokens of the iterations ending in each bin
    nb = max(1, min(THROUGHPUT_BINS, int(busy_it.sum())))
    bin_edges = np.linspace(t0, t1, nb + 1)
    bi = np.clip(np.searchsorted(bin_edges, ends, side="right") - 1, 0, nb - 1)
    per_bin = np.bincount(bi[busy_it], weights=tout[busy_it], minlength=nb)
    bin_s = (bin_edges[1] - bin_edges[0]) / 1e9 if nb else 1.0
    gpu = np.array([x.gpu_busy_us for x in iters])
    host = np.array([x.host_overhead_us for x in iters])
    return {
        "iterations": len(iters),
        "busy_iterations": int(busy_it.sum()),
        "tokens_in": int(tin.sum()),
        "tokens_out": int(tout.sum()),
        "span_us": span_us,
        # what tokens_per_s covers (completed by rate_interval): first to last model iteration
        "interval": _interval(iters, busy_it, span_us),
        "tokens_per_s": float(tout.sum() / (span_us / 1e6)) if tout.sum() else 0.0,
        "iteration_median_us": float(np.median(dur)),
        "by_phase": by_phase,
        "batch": {"median": float(np.median(batch)) if len(batch) else 0.0, "max": int(batch.max()) if len(batch) else 0,
                  "sizes": vals.tolist(), "iterations": counts.tolist()},
        "inter_token_us": {"p50": _pct(itl, 50), "p90": _pct(itl, 90), "max": float(itl.max()) if len(itl) else 0.0,
                           "samples": len(itl)},
        "gpu_busy_pct": (100.0 * float(gpu[busy_it].sum() / dur[busy_it].sum()) if rt_has_gpu and dur[busy_it].sum() > 0
                         else None),
        "host_overhead_pct": (100.0 * float(host[busy_it].sum() / dur[busy_it].sum())
                              if (host[busy_it] >= 0).all() and dur[busy_it].sum() > 0 else None),
        "histogram": {"edges_us": edges.tolist(), "counts": hist},
        "throughput": {"t_us": ((bin_edges[:-1] - t0) / NS_PER_US).tolist(),
                       "tokens_per_s": (per_bin / bin_s).tolist() if bin_s > 0 else []},
    }
