"""SLOW_INTERCONNECT: NCCL moves the collectives of NVLink-connected GPUs over a slower path.

Mechanism: GPUs of one host that NVLink connects (H100/H200/A100 SXM boards) reach a few hundred
GB/s of all-reduce bus bandwidth over it. When NCCL cannot use NVLink peer-to-peer (it is
disabled by NCCL_P2P_DISABLE / NCCL_P2P_LEVEL, a container without a shared IPC namespace, or
processes that cannot see each other's GPUs), it falls back to shared memory through the host
or to sockets: 5-25 GB/s, ten to seventy times slower. Every collective then takes that much
longer, on every rank.

Evidence: the collectives' *transfer* time (the last arriving rank's start-to-end, so the time
ranks spend waiting for each other is left out: ``diagnosis/job.py``), their message sizes from
the trace's collective arguments, and NCCL's bus-bandwidth factor: on a device with NVLink, all
ranks on one host, the best bus bandwidth of the large collectives stays under
:data:`SLOW_BUSBW_MAX_GBPS`. Only a job whose ranks are analysed together has transfer times;
a single rank's kernel durations include its waits and prove nothing about the link.

Fix priced on every rank at once by the joint replay: every matched collective's transfer at the
device's NVLink bus bandwidth (``diagnosis/hardware.py``) plus NCCL's intra-node latency.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.comm import BUSBW_FACTOR, DTYPE_BYTES, PCIE_GEN5_X16_GBPS
from aiprof.diagnosis.causes.common import ms, transfer_edits
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.hardware import device
from aiprof.diagnosis.model import EXPOSED_COMM, WAITING_RANK, Cause, Claim, Place

CODE = "SLOW_INTERCONNECT"
# Messages this large are bandwidth-bound (NCCL's latency, ~10-50 µs, is under a tenth of the
# transfer even at NVLink speed), so their bus bandwidth measures the link.
BANDWIDTH_REGIME_BYTES = 16 << 20
# Half of what one PCIe Gen5 x16 link carries: below it the collectives went neither over NVLink
# nor GPU-to-GPU over PCIe, but through host memory or sockets. Healthy NVLink DDP jobs in
# tests/data reach 85-290 GB/s on 28-176 MB all-reduces (overlapped with compute), 2.7x above.
SLOW_BUSBW_MAX_GBPS = PCIE_GEN5_X16_GBPS / 2
# NCCL's intra-node all-reduce latency (nccl-tests, small messages over NVLink): the floor of a
# fixed collective's transfer.
NVLINK_LATENCY_NS = 20_000.0
_NS_PER_S = 1e9


def collective_bytes(f: RankFacts, rc, ix: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Message bytes and type of the rank's matched collectives ``ix`` (indices into ``rc``), from
    the trace's GPU-side collective rows that start when they do (0 bytes when unknown)."""
    c = f.rt.collectives
    nbytes, types = np.zeros(len(ix)), [""] * len(ix)
    if not len(c) or rc.side != "gpu":
        return nbytes, types
    gpu = c.strings("side").isin_labels(lambda s: s == "gpu")
    t = c.take(gpu)
    order = np.argsort(t["ts"], kind="stable")
    ts = t["ts"][order]
    dtype, coll = t.strings("dtype"), t.strings("coll")
    esize = np.array([DTYPE_BYTES.get(s, 0) for s in dtype.labels] + [0], dtype=np.float64)[dtype.codes][order]
    nel = np.maximum(t["in_nelems"][order], 0).astype(np.float64)
    names = np.array(coll.labels + [""], dtype=object)[coll.codes][order]
    start = rc.start[ix]
    pos = np.clip(np.searchsorted(ts, start), 0, max(len(ts) - 1, 0))
    ok = len(ts) > 0
    for k, p in enumerate(pos.tolist()):
        if ok and ts[p] == start[k]:
            nbytes[k] = nel[p] * esize[p]
            types[k] = str(names[p])
    return nbytes, types


def link_counters(counters: list) -> dict | None:
    """What the GPU's PM counters read during the communication kernels (analysis.counters,
    per collective kernel), on the first rank that sampled them: NVLink bytes per second
    (the larger direction), its share of the link's peak, and PCIe (read + write). Only
    evidence: a link the collectives do not use reads ~0 (the sockets pair: 0.0001 GB/s
    against 219 GB/s on the same job over NVLink)."""
    for c in counters:
        colls = [x for x in (getattr(c, "collectives", None) or []) if x.get("sampled_us", 0) > 0]
        if not colls:
            continue
        w = np.array([x["sampled_us"] for x in colls], dtype=np.float64)

        def mean(key) -> float | None:
            v = [x["counters"].get(key) for x in colls]
            if any(y is None for y in v):
                return None
            return float(np.dot(np.array(v, dtype=np.float64), w) / w.sum())

        tx, rx = mean("pm_nvlink_tx_Bps"), mean("pm_nvlink_rx_Bps")
        if tx is None and rx is None:
            continue
        nv = max(tx or 0.0, rx or 0.0) / 1e9
        pcie = ((mean("pm_pcie_read_Bps") or 0.0) + (mean("pm_pcie_write_Bps") or 0.0)) / 1e9
        peak = getattr(c, "nvlink_peak_gbps", None)
        return {"nvlink_gbps": nv, "nvlink_pct_of_peak": 100.0 * nv / peak if peak else None, "pcie_gbps": pcie,
                "sampled_us": float(w.sum())}
    return None


def detect_job(facts: list[RankFacts], pricer, columns: dict, n_ranks: int | None = None) -> list[Cause]:
    """One cause for the job when its large collectives crawl on GPUs that NVLink connects.
    ``n_ranks``: the job's ranks when ``facts`` holds only some of them (a scaled-out analysis
    prices on a rank and its partner); ``columns`` needs the first rank's entries only."""
    f0 = facts[0]
    dev = device(f0.rt.device_name)
    n_ranks = n_ranks or len(facts)
    if dev is None or dev.nvlink_busbw_gbps <= 0 or n_ranks < 2:
        return []
    if n_ranks > len(f0.rt.meta.get("device_properties") or []):
        return []  # ranks on several hosts: the network sets the pace, not NVLink
    colls, idx = columns.get("collectives") or {}, columns.get("rank_index") or {}
    rc = colls.get(f0.rank)
    ix_all = idx.get(f0.rank)
    transfer = f0.graph.c_transfer
    if rc is None or ix_all is None or not transfer:
        return []
    ids = np.array(sorted(transfer), dtype=np.int64)
    ids = ids[ix_all[ids] >= 0]
    nbytes, types = collective_bytes(f0, rc, ix_all[ids])
    t_ns = np.array([transfer[int(c)] for c in ids], dtype=np.float64)
    fac = np.array([BUSBW_FACTOR.get(t, lambda n: 1.0)(n_ranks) for t in types])
    with np.errstate(divide="ignore", invalid="ignore"):
        busbw = np.where(t_ns > 0, nbytes * fac / t_ns, 0.0)  # bytes/ns == GB/s
    large = nbytes >= BANDWIDTH_REGIME_BYTES
    if not large.any():
        return []
    best = float(busbw[large].max())
    if best >= SLOW_BUSBW_MAX_GBPS:
        return []
    peak = dev.nvlink_busbw_gbps
    fixed = NVLINK_LATENCY_NS + nbytes * fac / peak
    known = nbytes > 0
    new_t = {int(c): float(min(t, x)) for c, t, x, k in zip(ids, t_ns, fixed, known) if k}
    edits = transfer_edits(facts, CODE, new_t)
    per = max(len(f0.steps), 1)
    top = int(np.argmax(np.where(large, nbytes, 0)))
    typical = float(np.median(busbw[large]))
    kind = types[top] or "collective"
    link = link_counters([f.counters for f in facts])
    claims = [Claim(EXPOSED_COMM, f.rank, float(sum(b.communication_us for b in f.breakdown))) for f in facts]
    claims += [Claim(WAITING_RANK, f.rank, 0.0) for f in facts]
    c = Cause(
        code=CODE, rank=None,
        title=(f"{kind} runs at {typical:.1f} GB/s bus bandwidth (best {best:.1f}) on {n_ranks} {dev.name}s that "
               f"NVLink connects at ~{peak:.0f} GB/s: NCCL is not using NVLink "
               f"({ms(float(t_ns.sum()) / per)} of transfer per step)"),
        mechanism=(f"Collectives of {nbytes[top] / 1e6:.0f} MB take {ms(float(t_ns[top]))} once every rank has arrived; "
                   f"at NVLink speed they take ~{ms(float(fixed[top]))}. A bus bandwidth under "
                   f"{SLOW_BUSBW_MAX_GBPS:.0f} GB/s means NCCL went through host memory (SHM) or sockets instead of "
                   f"GPU-to-GPU." + (f" The GPU's own counters agree: during them NVLink carried "
                                     f"{link['nvlink_gbps']:.2f} GB/s ({link['nvlink_pct_of_peak']:.2g} % of its peak) "
                                     f"and PCIe {link['pcie_gbps']:.1f} GB/s." if link else "")),
        remedy=("Let NCCL use NVLink peer-to-peer: run once with NCCL_DEBUG=INFO and look for 'via P2P/IPC' (good) "
                "against 'via SHM' or 'NET/Socket'; unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL, NCCL_SHM_DISABLE and "
                "NCCL_NET/NCCL_SOCKET_IFNAME overrides; in containers give the ranks a shared IPC namespace "
                "(--ipc=host) and let every rank see its peers' GPUs (CUDA_VISIBLE_DEVICES); `nvidia-smi topo -m` "
                "should show NV# between them."),
        place=Place("collective", f"{kind} of {nbytes[top] / 1e6:.0f} MB", "", [], []),
        evidence={"busbw_gbps_median": typical, "busbw_gbps_best": best, "nvlink_busbw_gbps": peak,
                  "large_collectives": int(large.sum()), "ranks": n_ranks, "device": dev.name,
                  "transfer_us_per_step": float(t_ns.sum()) / per / 1e3,
                  "fixed_transfer_us_per_step": float(np.minimum(t_ns, np.where(known, fixed, t_ns)).sum()) / per / 1e3,
                  **({"counters": link} if link else {})},
        edit=edits[f0.rank], claims=claims)
    others = {r: e for r, e in edits.items() if r != f0.rank}
    pricer.price(f0, c, None, others)
    return [c]
