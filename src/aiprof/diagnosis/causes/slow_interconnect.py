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
device's NVLink bus bandwidth (``aiprof/hardware.py``) plus NCCL's intra-node latency.

One rank alone (:func:`detect_rank`, a capture of some ranks only) has no transfer times, but
its GPU's PM counters say where the bytes went: a link the collectives use carries their bytes
while they run, so NVLink counting under a tenth of the least rate they needed (the bytes the
rank sends over the kernels' whole time, waits included) means they went another way. Priced
on that rank by replay: each communication kernel at most its NVLink transfer time; its waits
for the other ranks, if they were not slowed alike, stay in the kernel and are priced as saved
(an upper bound, which the cause says).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.comm import BUSBW_FACTOR, DTYPE_BYTES, PCIE_GEN5_X16_GBPS
from aiprof.diagnosis.causes.common import ms, transfer_edits
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import EXPOSED_COMM, WAITING_RANK, Cause, Claim, Place
from aiprof.hardware import device

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
# A link the collectives use carries all of their bytes while they run; a tenth of the least
# rate they needed leaves room for samples that straddle a kernel's edges. Rank 0 of the sockets
# pair read 0.00012 GB/s of NVLink against 3.3 GB/s needed; over NVLink, 219 against 54 GB/s.
UNUSED_LINK_FRACTION = 0.1
# Sample time under the communication kernels needed before the counters decide (20 samples at
# 100 µs: a link that carries the collectives cannot read ~0 in all of them; the healthy 2-rank
# capture in tests/data has 4.2 ms).
MIN_SAMPLED_US = 2_000.0


def collective_bytes(f: RankFacts, rc, ix: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Message bytes and type of the rank's matched collectives ``ix`` (indices into ``rc``), from
    the trace's GPU-side collective rows that start when they do (0 bytes when unknown)."""
    if rc.side != "gpu":
        return np.zeros(len(ix)), [""] * len(ix)
    return bytes_at(f, rc.start[ix])


def bytes_at(f: RankFacts, start: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Message bytes and type of the GPU-side collectives that start at ``start`` (trace ns), from
    the trace's collective rows (0 bytes and "" where none starts there)."""
    c = f.rt.collectives
    nbytes, types = np.zeros(len(start)), [""] * len(start)
    if not len(c):
        return nbytes, types
    gpu = c.strings("side").isin_labels(lambda s: s == "gpu")
    t = c.take(gpu)
    order = np.argsort(t["ts"], kind="stable")
    ts = t["ts"][order]
    dtype, coll = t.strings("dtype"), t.strings("coll")
    esize = np.array([DTYPE_BYTES.get(s, 0) for s in dtype.labels] + [0], dtype=np.float64)[dtype.codes][order]
    nel = np.maximum(t["in_nelems"][order], 0).astype(np.float64)
    names = np.array(coll.labels + [""], dtype=object)[coll.codes][order]
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


REMEDY = ("Let NCCL use NVLink peer-to-peer: run once with NCCL_DEBUG=INFO and look for 'via P2P/IPC' (good) "
          "against 'via SHM' or 'NET/Socket'; unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL, NCCL_SHM_DISABLE and "
          "NCCL_NET/NCCL_SOCKET_IFNAME overrides; in containers give the ranks a shared IPC namespace "
          "(--ipc=host) and let every rank see its peers' GPUs (CUDA_VISIBLE_DEVICES); `nvidia-smi topo -m` "
          "should show NV# between them.")


# Settings that keep NCCL off NVLink peer-to-peer within a host, and what each does. A capture
# whose meta.json records one of them (agent/commsettings.py) names it first in the remedy.
_OFF_NVLINK = (
    ("NCCL_P2P_DISABLE", lambda v: v.strip() not in ("", "0"), "turns NVLink/PCIe peer-to-peer off"),
    ("NCCL_P2P_LEVEL", lambda v: v.strip().upper() in ("LOC", "0"), "allows peer-to-peer only within one GPU"),
)
# NCCL's default channel count on an NVLink H100/H200 host is well above this: fewer channels than
# this leave most of the links' bandwidth unused whatever the transport (NCCL docs, NCCL_MAX_NCHANNELS).
FEW_CHANNELS = 4
# Settings that do not move NCCL off NVLink but change how it uses the links (or, with
# peer-to-peer off, which slower transport it falls back to): named after the above, never as
# the reason on their own.
_ALSO_SHAPING = (
    ("NCCL_SHM_DISABLE", lambda v: v.strip() not in ("", "0"), "turns the shared-memory fallback off"),
    ("NCCL_NET", lambda v: bool(v.strip()), "picks the network transport"),
    ("NCCL_PROTO", lambda v: bool(v.strip()), "pins the protocol"),
    ("NCCL_ALGO", lambda v: bool(v.strip()), "pins the algorithm"),
    ("NCCL_MAX_NCHANNELS", lambda v: v.strip().isdigit() and int(v) < FEW_CHANNELS,
     f"limits NCCL to fewer than {FEW_CHANNELS} channels"),
)


def _recorded(facts: list[RankFacts], table: tuple) -> list[dict]:
    out: dict[str, dict] = {}
    for f in facts:
        env = (((f.rt.meta.get("capture") or {}).get("communication") or {}).get("env") or {})
        for name, bad, what in table:
            v = env.get(name)
            if isinstance(v, str) and bad(v) and name not in out:
                out[name] = {"name": name, "value": v, "effect": what}
    return list(out.values())


def off_nvlink_settings(facts: list[RankFacts]) -> list[dict]:
    """The settings of _OFF_NVLINK, then of _ALSO_SHAPING, that the ranks' captures recorded
    (name, value, what it does, and whether it keeps NCCL off NVLink)."""
    return ([{**x, "off_nvlink": True} for x in _recorded(facts, _OFF_NVLINK)]
            + [{**x, "off_nvlink": False} for x in _recorded(facts, _ALSO_SHAPING)])


def _named(found: list[dict]) -> str:
    return ", ".join(f"{s['name']}={s['value']} ({s['effect']})" for s in found)


def remedy_for(facts: list[RankFacts]) -> str:
    """The remedy: led by a recorded setting that keeps NCCL off NVLink, else the general one;
    settings that only shape how NCCL uses the links follow, as something to try without."""
    found = off_nvlink_settings(facts)
    off = [s for s in found if s["off_nvlink"]]
    also = [s for s in found if not s["off_nvlink"]]
    if off:
        head = (f"This job ran with {_named(off)}: unset {'it' if len(off) == 1 else 'them'} so that NCCL uses "
                "NVLink peer-to-peer, and check with NCCL_DEBUG=INFO that the log shows 'via P2P/IPC'.")
    else:
        head = REMEDY
    if also:
        head += (f" It also set {_named(also)}: {'this does' if len(also) == 1 else 'these do'} not keep NCCL off "
                 "NVLink but change how it uses the links; time a run without "
                 f"{'it' if len(also) == 1 else 'them'}.")
    return head


def _nvlink_host(f: RankFacts, n_ranks: int):
    """The rank's device when NVLink connects it to the job's other ranks (all on its host), else None."""
    dev = device(f.rt.device_name)
    if dev is None or dev.nvlink_busbw_gbps <= 0 or n_ranks < 2:
        return None
    if n_ranks > len(f.rt.meta.get("device_properties") or []):
        return None  # ranks on several hosts: the network sets the pace, not NVLink
    return dev


def detect_rank(f: RankFacts) -> list[Cause]:
    """The cause on one rank analysed alone, from its GPU's counters (module docstring); the
    engine prices it on that rank."""
    n_ranks = f.rt.world_size
    dev = _nvlink_host(f, n_ranks)
    if dev is None:
        return []
    link = link_counters([f.counters])
    if link is None or link["sampled_us"] < MIN_SAMPLED_US:
        return []
    g, k = f.graph, f.rt.kernels
    if not g.n_ops or not len(k) or "cls" not in k:
        return []
    comm = k.strings("cls").isin_labels(lambda s: s == "communication")
    kern = np.nonzero((g.o_table == 0) & (g.o_dur > 0))[0]
    ops = kern[comm[g.o_row[kern]]]
    nbytes, types = bytes_at(f, g.o_ts[ops].astype(np.int64))
    fac = np.array([BUSBW_FACTOR.get(t, lambda n: 1.0)(n_ranks) for t in types])
    sent = nbytes * fac  # bytes this rank sends per collective (NCCL's bus-bandwidth factor)
    known = nbytes > 0
    if not (nbytes >= BANDWIDTH_REGIME_BYTES).any():
        return []
    needed_gbps = float(sent[known].sum() / g.o_dur[ops][known].sum())  # bytes/ns == GB/s
    if link["nvlink_gbps"] >= UNUSED_LINK_FRACTION * needed_gbps:
        return []
    peak = dev.nvlink_busbw_gbps
    fixed = NVLINK_LATENCY_NS + sent / peak
    new_dur = np.where(known, np.minimum(g.o_dur[ops], fixed), g.o_dur[ops])
    e = f.edit(CODE)
    e.op_dur[ops] = new_dur
    per = max(len(f.steps), 1)
    top = int(np.argmax(nbytes))
    kind = types[top] or "collective"
    comm_ns = float(g.o_dur[ops].sum())
    c = Cause(
        code=CODE, rank=f.rank,
        title=(f"NVLink carried {link['nvlink_gbps']:.2g} GB/s while {kind} kernels ran ({ms(comm_ns / per)} per step) "
               f"on this {dev.name}, which NVLink connects to its peers: NCCL is not using NVLink"),
        mechanism=(f"This rank's collectives send at least {needed_gbps:.1f} GB/s while their kernels run (their bytes over "
                   f"the kernels' whole time, waits included), yet the GPU's own counters read {link['nvlink_gbps']:.2g} "
                   f"GB/s of NVLink and {link['pcie_gbps']:.1f} GB/s of PCIe during them: the data went through host "
                   f"memory (SHM) or sockets, not GPU-to-GPU. At NVLink speed a {nbytes[top] / 1e6:.0f} MB {kind} takes "
                   f"~{ms(float(fixed[top]))}. Priced on this rank alone: waits for other ranks inside its kernels "
                   f"count as saved, so this is an upper bound unless every rank was slowed alike."),
        remedy=remedy_for([f]),
        place=Place("collective", f"{kind} of {nbytes[top] / 1e6:.0f} MB", "", [], []),
        evidence={"settings": off_nvlink_settings([f]), "nvlink_gbps_needed_at_least": needed_gbps, "nvlink_busbw_gbps": peak, "ranks": n_ranks,
                  "device": dev.name, "communication_us_per_step": comm_ns / per / 1e3,
                  "fixed_communication_us_per_step": float(new_dur.sum()) / per / 1e3,
                  "large_collectives": int((nbytes >= BANDWIDTH_REGIME_BYTES).sum()), "counters": link,
                  "from": "GPU counters (one rank)"},
        edit=e,
        claims=[Claim(EXPOSED_COMM, f.rank, float(sum(b.communication_us for b in f.breakdown)))])
    return [c]


def detect_job(facts: list[RankFacts], pricer, columns: dict, n_ranks: int | None = None) -> list[Cause]:
    """One cause for the job when its large collectives crawl on GPUs that NVLink connects.
    ``n_ranks``: the job's ranks when ``facts`` holds only some of them (a scaled-out analysis
    prices on a rank and its partner); ``columns`` needs the first rank's entries only."""
    f0 = facts[0]
    n_ranks = n_ranks or len(facts)
    dev = _nvlink_host(f0, n_ranks)
    if dev is None:
        return []
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
        remedy=remedy_for(facts),
        place=Place("collective", f"{kind} of {nbytes[top] / 1e6:.0f} MB", "", [], []),
        evidence={"settings": off_nvlink_settings(facts), "busbw_gbps_median": typical, "busbw_gbps_best": best, "nvlink_busbw_gbps": peak,
                  "large_collectives": int(large.sum()), "ranks": n_ranks, "device": dev.name,
                  "transfer_us_per_step": float(t_ns.sum()) / per / 1e3,
                  "fixed_transfer_us_per_step": float(np.minimum(t_ns, np.where(known, fixed, t_ns)).sum()) / per / 1e3,
                  **({"counters": link} if link else {})},
        edit=edits[f0.rank], claims=claims)
    others = {r: e for r, e in edits.items() if r != f0.rank}
    pricer.price(f0, c, None, others)
    return [c]


def detect(job: JobFacts) -> list[Cause]:
    return detect_job(job.facts, job.pricer, job.columns, job.n_ranks or None)


# a rank whose job has no transfer times (analysed alone): its GPU's counters; a coupled job: the
# collectives' transfer times
ON_ONE_RANK = Detector(CODE, Scope.UNCOUPLED, reads=("breakdown", "counters", "graph", "rt", "steps"), detect=detect_rank)
DETECTOR = Detector(CODE, Scope.JOB, reads=("facts", "pricer", "columns", "n_ranks"), detect=detect)
