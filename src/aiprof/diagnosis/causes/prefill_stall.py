"""PREFILL_STALLS_DECODE: a long prefill runs while other sequences are decoding.

Mechanism: an iteration that processes a whole prompt takes many times a decode iteration, and
every sequence already decoding waits for it: its next token comes that much later (the
inter-token latency spikes) and, when the prompt runs as its own iteration, the engine pays a
whole extra forward's host overhead for it. Chunked prefill splits the prompt into pieces that
ride along with the decode iterations, so no running sequence waits for more than a chunk.

Evidence: prefill or mixed iterations (analysis/serving.py) after the first decode of a run,
at least STALL_FACTOR times the median decode iteration. Fix priced: a prompt run as its own
iteration is folded into the decode iterations (its host overhead goes, its GPU work stays: the
replay keeps every kernel); the latency effect is in the evidence (the longest inter-token gap
now and with chunks of one decode iteration's work), and the cause is reported for it even when
the replay prices the throughput gain low.
"""
from __future__ import annotations

import math

import numpy as np

from aiprof.analysis.serving import DECODE, MIXED, PREFILL
from aiprof.diagnosis.causes import serving_common as sc
from aiprof.diagnosis.causes.common import ms
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import SLOW_STEP, Cause, Claim, Place

CODE = "PREFILL_STALLS_DECODE"
# A prompt iteration this many times the median decode iteration stalls the running sequences
# noticeably (twice would be one skipped token; three times is a visible stutter).
STALL_FACTOR = 3.0


def remedy_for(engine: str, chunk_tokens: int) -> str:
    if engine == sc.CB:
        return (f"Cap the tokens per iteration so prompts are chunked finer: ContinuousBatchingConfig("
                f"max_batch_tokens~{chunk_tokens}) (the scheduler splits prompts to fit and mixes them with decodes).")
    if engine == sc.VLLM:
        return (f"Enable chunked prefill with a token budget near {chunk_tokens}: enable_chunked_prefill=True, "
                f"max_num_batched_tokens={chunk_tokens}.")
    return (f"Chunk prompts: process at most ~{chunk_tokens} prompt tokens per iteration together with the running "
            "decodes (chunked prefill: vLLM enable_chunked_prefill, transformers continuous batching's "
            "max_batch_tokens) instead of whole prompts on their own.")


def detect(f: RankFacts) -> list[Cause]:
    sv = sc.serving(f)
    if sv is None or not len(f.steps):
        return []
    ph = sc.phases(f)
    dec = ph == DECODE
    if dec.sum() < sc.MIN_DECODE_ITERATIONS:
        return []
    dur = np.array([it.duration_us for it in sv.iterations])
    med = float(np.median(dur[dec]))
    seen_decode = np.cumsum(dec) > 0
    # a prompt iteration after decoding started, while sequences are running
    stall = np.isin(ph, (PREFILL, MIXED)) & np.concatenate([[False], seen_decode[:-1]]) & (dur >= STALL_FACTOR * med)
    if not stall.any():
        return []
    g = f.graph
    e = f.edit(CODE)
    # prompts that ran as their own iteration fold into the decode iterations: their host time goes
    alone = stall & (ph == PREFILL)
    acts = sc.actions_in(f, alone)
    e.gap_remove[acts] = np.maximum(g.gap[acts], 0)
    e.cost_remove[acts] = g.cost[acts] * (g.a_wait[acts] < 0)
    worst = float(dur[stall].max())
    extra = dur[stall] - med
    # chunks of about one decode iteration's work: the worst gap becomes about two decode iterations
    tokens = max((sv.iterations[int(i)].tokens_in for i in np.nonzero(stall)[0]), default=0)
    chunks = max(1, math.ceil(float(extra.max()) / med))
    chunk_tokens = max(1, math.ceil(tokens / chunks)) if tokens > 0 else 0
    steps = [int(f.steps.number[i]) for i in np.nonzero(stall)[0]]
    eng = sc.engine(f)
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{int(stall.sum())} prompt iteration(s) run while sequences decode, the longest {ms(worst * 1e3)} "
               f"= {worst / med:.1f}x a decode iteration ({ms(med * 1e3)}): every running sequence waits that long "
               "for its next token"),
        mechanism=("A prompt processed whole takes many decode iterations' time, and every sequence already decoding "
                   "waits for it; chunked prefill lets the prompt ride along in pieces."),
        remedy=remedy_for(eng, chunk_tokens or 512), place=Place("step", "prefill iterations", "", [], steps),
        evidence={"stall_iterations": int(stall.sum()), "alone": int(alone.sum()), "worst_us": worst,
                  "median_decode_us": med, "stall_extra_us": float(extra.sum()),
                  "max_inter_token_us": float(sv.summary.get("inter_token_us", {}).get("max", 0.0)),
                  "predicted_max_inter_token_us": 2 * med, "chunks": chunks, "chunk_tokens": chunk_tokens,
                  "engine": eng, "always_reported": True},
        edit=e, claims=[Claim(SLOW_STEP, f.rank, float(extra.sum()))])]


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "steps"), detect=detect)
