"""EXPOSED_BUCKET_COMM: gradient all-reduces in buckets too large to overlap the backward pass.

Mechanism: DDP all-reduces the gradients in buckets (``bucket_cap_mb``, 25 MB by default),
each launched as soon as its gradients are ready, so the communication runs under the rest of
the backward pass. A bucket cannot start before its *last* gradient is ready: the bigger the
bucket, the later it starts and the more of its transfer is left once the backward compute has
ended (with one bucket per step, nothing overlaps: the whole all-reduce sits between the last
backward kernel and the optimizer). Smaller buckets start while the backward is still running.

Evidence: the rank's GPU all-reduces matched across the job and launched from a gradient hook
(inside an autograd op: sizes from the trace's collective arguments), each one's *last arrival* (the latest rank's start, so the time ranks
wait for a slower peer is left out: that is STRAGGLER) and its *transfer* time (the last
arriver's start-to-end: ``diagnosis/job.py``), the backward-pass starts (the first autograd op
of each backward), and the largest gradient (``AccumulateGrad`` shapes, when recorded): a
gradient is never split across buckets.

What-if: each bucket's gradients are taken to become ready evenly between the previous
bucket's last arrival (the backward's first GPU op, for the first bucket of a pass) and its
own; re-split into pieces of the derived bucket size, each piece starts when ready and the
comm stream is free, and takes its share of the bucket's measured transfer plus NCCL's latency.
Each collective's new transfer is what it still takes after its last arrival; the joint replay
of every rank prices it, so only time off the critical path of the job counts.
"""
from __future__ import annotations

import ast
import math

import numpy as np

from aiprof.analysis.comm import DTYPE_BYTES
from aiprof.diagnosis.causes.common import ms, transfer_edits
from aiprof.diagnosis.causes.slow_interconnect import (
    NVLINK_LATENCY_NS,
    collective_bytes,
)
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import EXPOSED_COMM, MIN_REPORTED_SHARE, Cause, Claim, Place

CODE = "EXPOSED_BUCKET_COMM"
# DDP's default bucket_cap_mb: the largest bucket recommended (PyTorch's tested default).
DEFAULT_BUCKET_MB = 25.0
# A bucket must move at least this many NCCL latencies' worth of data: smaller buckets spend
# over a fifth of their transfer in per-call latency and only add calls.
MIN_BUCKET_LATENCIES = 4.0
# The bucket left exposed after the last backward kernel should take at most this share of the
# step: below MIN_REPORTED_SHARE, a tail no diagnosis would report.
TAIL_TARGET_SHARE = MIN_REPORTED_SHARE
# A bucket is re-split only when it holds at least this many target-sized pieces: a bucket under
# twice the target already starts about as early as the target would let it.
SPLIT_MIN_PIECES = 2.0
_BACKWARD_OP = "autograd::engine::evaluate_function: "
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_MB = 1e6


def _largest_grad_bytes(f: RankFacts) -> float:
    """Bytes of the largest gradient accumulated in the window (AccumulateGrad input shapes), 0
    when shapes were not recorded: then no gradient is known to be too big to split."""
    o = f.rt.table("ops")
    if not len(o) or "input_dims" not in o:
        return 0.0
    names = o.strings("name")
    m = names.isin_labels(lambda s: s == _ACCUMULATE) & (o["ts"] >= f.graph.lo) & (o["ts"] < f.graph.hi)
    if not m.any():
        return 0.0
    dims, types = o.strings("input_dims"), o.strings("input_types")
    best = 0.0
    for d, t in set(zip(dims.codes[m].tolist(), types.codes[m].tolist())):
        try:
            shape = ast.literal_eval(dims.labels[d])[0]
            dtype = ast.literal_eval(types.labels[t])[0] if types.labels[t] else "float"
        except (ValueError, SyntaxError, IndexError, TypeError):
            continue
        if shape:
            best = max(best, float(np.prod(shape)) * DTYPE_BYTES.get(dtype, 4))
    return best


def _pass_gpu_starts(f: RankFacts) -> np.ndarray:
    """GPU start (rank clock, sorted) of each backward pass: the first compute op launched at or
    after the pass's first autograd op (the op of that name that opens the step's backward)."""
    o, g = f.rt.table("ops"), f.graph
    if not len(o) or not g.n_ops:
        return np.zeros(0)
    names = o.strings("name")
    bw = names.isin_labels(lambda s: s.startswith(_BACKWARD_OP)) & (o["ts"] >= g.lo) & (o["ts"] < g.hi)
    idx = np.nonzero(bw)[0]
    if not len(idx):
        return np.zeros(0)
    idx = idx[np.argsort(o["ts"][idx], kind="stable")]
    step = f.steps.index_of(o["ts"][idx])
    starts = []
    for s in np.unique(step[step >= 0]):
        in_s = idx[step == s]
        root = names.codes[in_s[0]]  # the op that opens a backward pass (the loss's grad_fn)
        starts += o["ts"][in_s[names.codes[in_s] == root]].tolist()
    comp = np.nonzero(g.o_coll < 0)[0] if g.o_coll is not None else np.arange(g.n_ops)
    launch = g.a_ts[g.o_action[comp]]  # non-decreasing: ops are ordered by launching action
    out = []
    for h in sorted(starts):
        p = int(np.searchsorted(launch, h))
        if p < len(comp):
            out.append(float(g.o_ts[comp[p]]))
    return np.array(out)


def _rank_collectives(f: RankFacts) -> dict[int, tuple[float, float]]:
    """Matched GPU collective id -> (host launch, GPU start), rank clock: only those launched
    from inside an autograd op (a gradient hook: DDP's buckets), not a forward's tensor-parallel
    all-reduce or the user's own collectives, whose data is not produced during a backward."""
    g = f.graph
    o = f.rt.table("ops")
    if g.o_coll is None or not len(o):
        return {}
    bw = o.strings("name").isin_labels(lambda s: s.startswith(_BACKWARD_OP))
    s, e = o["ts"][bw], o["ts"][bw] + o["dur"][bw]
    order = np.argsort(s, kind="stable")
    s, reach = s[order], np.maximum.accumulate(e[order])  # latest end among ops started so far
    out = {}
    for j in np.nonzero(g.o_coll >= 0)[0]:
        h = float(g.a_ts[g.o_action[j]])
        p = int(np.searchsorted(s, h, side="right")) - 1
        if p >= 0 and reach[p] >= h:
            out[int(g.o_coll[j])] = (h, float(g.o_ts[j]))
    return out


def split_schedule(ready_from: np.ndarray, arrive: np.ndarray, transfer: np.ndarray, nbytes: np.ndarray,
                   piece: float, unsplit: float, latency: float) -> tuple[np.ndarray, np.ndarray]:
    """The comm stream, bucket by bucket in order: (recorded end, end once re-split), same clock.

    Bucket k's gradients are ready evenly over [ready_from[k], arrive[k]] (its last arrival);
    a bucket of at least SPLIT_MIN_PIECES pieces is cut into pieces of ``piece`` bytes (the
    ``unsplit`` bytes of the largest gradient stay whole, in the last piece), each taking its
    share of the measured ``transfer`` plus one more ``latency`` per extra piece."""
    n = len(arrive)
    old, new = np.zeros(n), np.zeros(n)
    t_old = t_new = -math.inf
    for k in range(n):
        t_old = max(arrive[k], t_old) + transfer[k]
        old[k] = t_old
        splittable = nbytes[k] - (unsplit if nbytes[k] >= unsplit else 0.0)
        m = int(splittable // piece) if piece > 0 and nbytes[k] >= SPLIT_MIN_PIECES * piece else 0
        if m < 1 or nbytes[k] <= 0:
            t_new = max(arrive[k], t_new) + transfer[k]
            new[k] = t_new
            continue
        body = max(transfer[k] - latency, 0.0)
        sizes = [piece] * m + ([nbytes[k] - m * piece] if nbytes[k] - m * piece > 0 else [])
        done = 0.0
        for sz in sizes:
            done += sz
            ready = ready_from[k] + (arrive[k] - ready_from[k]) * done / nbytes[k]
            t_new = max(ready, t_new) + body * sz / nbytes[k] + latency
        new[k] = t_new
    return old, new


def derived_bucket_bytes(algbw_gbps: float, step_ns: float, latency: float) -> float:
    """The bucket size to recommend: the largest whose transfer leaves a tail under
    TAIL_TARGET_SHARE of the step, at least MIN_BUCKET_LATENCIES latencies' worth of data, at most
    DDP's default (bytes/ns == GB/s)."""
    tail = TAIL_TARGET_SHARE * step_ns * algbw_gbps
    floor = MIN_BUCKET_LATENCIES * latency * algbw_gbps
    return float(np.clip(tail, floor, DEFAULT_BUCKET_MB * _MB)) if floor < DEFAULT_BUCKET_MB * _MB \
        else DEFAULT_BUCKET_MB * _MB


def detect_job(facts: list[RankFacts], pricer, columns: dict) -> list[Cause]:
    """One cause for the job when its all-reduce buckets are too large to hide under backward."""
    f0 = facts[0]
    colls, idx = columns.get("collectives") or {}, columns.get("rank_index") or {}
    rc, ix_all = colls.get(f0.rank), idx.get(f0.rank)
    g0 = f0.graph
    if rc is None or ix_all is None or rc.side != "gpu" or not g0.c_transfer or len(facts) < 2:
        return []
    off = {f.rank: float(f.extra.get("offset_ns", 0.0)) for f in facts}
    mine = {f.rank: _rank_collectives(f) for f in facts}
    ids = np.array(sorted(c for c in mine[f0.rank] if c in g0.c_transfer and all(c in m for m in mine.values())),
                   dtype=np.int64)
    if not len(ids):
        return []
    nbytes, types = collective_bytes(f0, rc, ix_all[ids])
    keep = (nbytes > 0) & np.array([t == "AllReduce" for t in types])
    ids, nbytes = ids[keep], nbytes[keep]
    if not len(ids):
        return []
    # the last arrival (common clock) and transfer of each collective, in order of arrival
    arrive = np.array([max(mine[r][int(c)][1] + off[r] for r in mine) for c in ids])
    order = np.argsort(arrive, kind="stable")
    ids, nbytes, arrive = ids[order], nbytes[order], arrive[order]
    transfer = np.array([g0.c_transfer[int(c)] for c in ids])
    # where each bucket's gradients start to be ready: the previous bucket's last arrival, or the
    # latest backward-pass start on any rank before this bucket's launch, whichever is later
    pass_starts = {f.rank: _pass_gpu_starts(f) + off[f.rank] for f in facts}
    ready_from = np.empty(len(ids))
    for k, c in enumerate(ids):
        bw = []
        for f in facts:
            ps = pass_starts[f.rank]
            p = int(np.searchsorted(ps, mine[f.rank][int(c)][1] + off[f.rank], side="right")) - 1
            if p >= 0:
                bw.append(ps[p])
        first = max(bw) if len(bw) == len(facts) else arrive[k]
        ready_from[k] = max(first, arrive[k - 1]) if k else first
    step_ns = f0.base.per_step_ns
    big = nbytes >= np.median(nbytes)
    algbw = float(np.median(nbytes[big] / np.maximum(transfer[big], 1.0)))  # bytes/ns == GB/s
    piece = derived_bucket_bytes(algbw, step_ns, NVLINK_LATENCY_NS)
    unsplit = max(_largest_grad_bytes(f) for f in facts)
    old, new = split_schedule(ready_from, arrive, transfer, nbytes, piece, unsplit, NVLINK_LATENCY_NS)
    if not (new < old - 1.0).any():
        return []
    prev_new = np.concatenate([[-math.inf], new[:-1]])
    new_t = {int(c): float(max(e - max(a, p), 0.0)) for c, e, a, p in zip(ids, new, arrive, prev_new)}
    edits = transfer_edits(facts, CODE, new_t)
    per = max(len(f0.steps), 1)
    split = nbytes >= SPLIT_MIN_PIECES * piece
    top = int(np.argmax(np.where(split, old - arrive, -np.inf)))
    n_buckets = len(ids) / per
    tail_old = float((old - arrive).clip(min=0)[split].sum()) / per
    tail_new = float((new - arrive).clip(min=0)[split].sum()) / per
    mb = max(1, int(piece // _MB))
    claims = [Claim(EXPOSED_COMM, f.rank, float(sum(b.communication_us for b in f.breakdown))) for f in facts]
    c = Cause(
        code=CODE, rank=None,
        title=(f"gradient all-reduce in {n_buckets:.0f} bucket(s) per step (largest {nbytes.max() / _MB:.0f} MB): "
               f"{ms(tail_old)} of transfer per step runs after its bucket's last gradient, not under the backward"),
        mechanism=(f"A bucket is all-reduced only once its last gradient is ready. The {nbytes[top] / _MB:.0f} MB bucket "
                   f"starts {ms(float(arrive[top] - ready_from[top]))} after its first gradient could have been sent and "
                   f"then takes {ms(float(transfer[top]))} at {algbw:.0f} GB/s; cut into {mb} MB buckets, all but the "
                   f"last piece would move while the backward still computes."),
        remedy=(f"Use smaller gradient buckets: DistributedDataParallel(model, bucket_cap_mb={mb}) in place of the "
                f"larger setting ({mb} MB moves in ~{ms(piece / algbw + NVLINK_LATENCY_NS)} at the measured "
                f"{algbw:.0f} GB/s: the bucket left after the last backward kernel costs under "
                f"{TAIL_TARGET_SHARE:.0%} of the step)."),
        place=Place("collective", f"AllReduce of {nbytes[top] / _MB:.0f} MB (DDP gradient bucket)", "", [], []),
        evidence={"buckets_per_step": n_buckets, "bucket_mb": sorted({round(float(b) / _MB, 1) for b in nbytes}),
                  "algbw_gbps": algbw, "derived_bucket_mb": mb, "largest_gradient_mb": unsplit / _MB,
                  "tail_transfer_us_per_step": tail_old / 1e3, "fixed_tail_us_per_step": tail_new / 1e3,
                  "split_buckets_per_step": float(split.sum()) / per, "ranks": len(facts)},
        edit=edits[f0.rank], claims=claims)
    pricer.price(f0, c, None, {r: e for r, e in edits.items() if r != f0.rank})
    return [c]


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer, job.columns)


DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer", "columns"), detect=detect, experimental=True)
