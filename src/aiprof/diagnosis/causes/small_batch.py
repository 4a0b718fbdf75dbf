"""SMALL_BATCH: decode iterations serve too few sequences for the GPU they run on.

Mechanism: a decode iteration costs about the same whether it carries one sequence or many:
the host launches the same kernels and the GPU reads the same weights; only attention and the
activations grow with the batch. An iteration with few sequences, on a GPU idle most of it,
makes few tokens for that cost. Continuous batching (new requests join the running batch at every
iteration) and a larger maximum batch fill it.

Evidence: the sequences sampled per decode iteration (analysis/serving.py), and the decode
iterations' GPU-busy share: with GPU time growing at worst linearly with the batch, up to
k = iteration time / GPU busy time times the sequences fit in the same iteration. Fix priced: the
same tokens in 1/k of the decode iterations (the others removed from the replay), the kept ones
with their GPU work times k.
"""
from __future__ import annotations

import numpy as np

from aiprof.diagnosis.causes import serving_common as sc
from aiprof.diagnosis.causes.common import idle_claim, ms
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "SMALL_BATCH"
# The batch factor suggested is at most this (beyond it attention and activations stop being
# negligible and the linear-growth bound says little).
MAX_BATCH_FACTOR = 16
# Below this factor the GPU has no room for more sequences: no cause.
MIN_BATCH_FACTOR = 2


def remedy_for(engine: str, batch: float, k: int) -> str:
    target = round(max(batch, 1) * k)
    if engine == sc.CB:
        return (f"Keep ~{target} requests in flight (the client sends more concurrently) and let the batch grow: "
                f"ContinuousBatchingConfig(max_requests_per_batch>={target}) with a max_batch_tokens that admits them.")
    if engine == sc.VLLM:
        return f"Send more concurrent requests and raise max_num_seqs (and max_num_batched_tokens) to >= {target}."
    return (f"Batch the requests: serve them with continuous batching (transformers model.generate_batch / "
            f"ContinuousBatchingManager, vLLM, TGI) so ~{target} sequences share every decode iteration, instead of "
            f"{batch:.0f} per model call.")


def detect(f: RankFacts) -> list[Cause]:
    dec = sc.gpu_decode_steps(f)
    if dec is None:
        return []
    g = f.graph
    sv = sc.serving(f)
    dur = sc.median_of(f, dec, "duration_us")
    busy = sc.median_of(f, dec, "gpu_busy_us")
    batch = float(np.median([it.tokens_out for it, m in zip(sv.iterations, dec) if m]))
    if busy <= 0 or batch <= 0:
        return []
    k = int(min(MAX_BATCH_FACTOR, dur // busy))
    if k < MIN_BATCH_FACTOR:
        return []
    # the replay window's decode iterations, in order: keep one in k
    step_of_action = f.steps.index_of(g.a_ts)
    win = np.nonzero(dec & np.isin(f.steps.number, g.step_number))[0]
    if len(win) < sc.MIN_DECODE_ITERATIONS:
        return []
    dropped = np.zeros(len(f.steps), dtype=bool)
    kept = np.zeros(len(f.steps), dtype=bool)
    dropped[win[np.arange(len(win)) % k != 0]] = True
    kept[win[np.arange(len(win)) % k == 0]] = True
    ok = step_of_action >= 0
    drop_a = np.zeros(g.n_actions, dtype=bool)
    drop_a[ok] = dropped[step_of_action[ok]]
    keep_a = np.zeros(g.n_actions, dtype=bool)
    keep_a[ok] = kept[step_of_action[ok]]
    e = f.edit(CODE)
    e.gap_remove[drop_a] = np.maximum(g.gap[drop_a], 0)
    e.cost_remove[drop_a] = g.cost[drop_a]
    e.no_wait[drop_a] = True
    e.drop_op[drop_a[g.o_action]] = True
    grow = keep_a[g.o_action]
    e.op_dur[grow] = g.o_dur[grow] * k
    region = sc.nodes_in(f, dec)
    claims = idle_claim(f, region)
    idle_iters = int(sc.step_mask(f, ("idle",)).sum())
    eng = sc.engine(f)
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"decode serves {batch:.0f} sequence(s) per iteration and the GPU is busy {100 * busy / dur:.0f}% of "
               f"it ({ms(busy * 1e3)} of {ms(dur * 1e3)}): {k}x the sequences would fit in the same iteration time"),
        mechanism=("A decode iteration costs about the same for one sequence or many (the same launches, the same "
                   "weights read); few sequences per iteration make few tokens for that cost."),
        remedy=remedy_for(eng, batch, k), place=Place("step", "decode iterations", "", [], []),
        evidence={"median_batch": batch, "batch_factor": k, "decode_iterations": int(dec.sum()),
                  "median_decode_us": dur, "median_decode_gpu_busy_us": busy, "idle_iterations": idle_iters,
                  "max_batch_seen": int(sv.summary.get("batch", {}).get("max", 0)), "engine": eng},
        edit=e, claims=claims)]


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "steps"), detect=detect)
