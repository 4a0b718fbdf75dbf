"""PAGEABLE_COPY: host<->device copies from pageable memory.

Mechanism: a copy from pageable host memory is staged by the driver through a pinned buffer,
runs at a fraction of the link's bandwidth and blocks the host until it is done, so it can
neither overlap compute nor let the host run ahead. Evidence: copies named
``Memcpy HtoD (Pageable -> Device)`` (or DtoH to pageable). Fix priced: the copy at the pinned
bandwidth of the device's link, and the host no longer waiting for it.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.diagnosis.causes.common import idle_claim, ms, owned_actions, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.hardware import device
from aiprof.diagnosis.model import EXPOSED_COPY, Cause, Claim, Place
from aiprof.trace import classify

CODE = "PAGEABLE_COPY"
# A pinned copy smaller than this is latency-bound: its bandwidth says nothing about the link.
MIN_BW_SAMPLE_BYTES = 1 << 20


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    m = f.rt.memops
    if not g.n_ops or not len(m):
        return []
    names = m.strings("name")
    pageable_label = np.array(["Pageable" in classify.copy_kind(s)[1:] for s in names.labels] + [False])
    pinned_label = np.array([("Pinned" in classify.copy_kind(s)[1:]) for s in names.labels] + [False])
    mem = g.o_table == 1
    page = np.zeros(g.n_ops, dtype=bool)
    page[mem] = pageable_label[names.codes[g.o_row[mem]]]
    # a copy made inside a region an earlier cause owns (a checkpoint's) is that cause's
    page &= ~owned_actions(f)[g.o_action]
    if not page.any():
        return []
    nbytes = np.zeros(g.n_ops)
    nbytes[mem] = np.maximum(m["bytes"][g.o_row[mem]], 0)
    # the pinned bandwidth: this trace's own large pinned copies, else the device's link
    pin = np.zeros(g.n_ops, dtype=bool)
    pin[mem] = pinned_label[names.codes[g.o_row[mem]]]
    pin &= nbytes >= MIN_BW_SAMPLE_BYTES
    dev = device(f.rt.device_name)
    if pin.any():
        bw = float(nbytes[pin].sum() / g.o_dur[pin].sum())  # bytes/ns == GB/s
        bw_from = "this trace's pinned copies"
    elif dev is not None:
        bw, bw_from = dev.pinned_h2d_gbps, f"{dev.name} pinned copies measured"
    else:
        return []
    e = f.edit(CODE)
    e.op_dur[page] = np.minimum(g.o_dur[page], nbytes[page] / bw)
    e.no_wait[g.o_action[page]] = True
    # the synchronisation torch makes after a pageable copy (inside the same op) goes too
    anodes = f.action_nodes()
    if len(f.tree):
        op_of = np.where(anodes >= 0, f.tree.nearest(np.maximum(anodes, 0), OP), -1)
        copy_ops = set(op_of[g.o_action[page]].tolist()) - {-1}
        e.no_wait[np.isin(op_of, list(copy_ops)) & (g.a_wait >= 0)] = True
    per = max(len(f.steps), 1)
    t = float(g.o_dur[page].sum())
    b = float(nbytes[page].sum())
    acts = np.unique(g.o_action[page])
    node = int(f.action_nodes()[acts[0]]) if len(acts) else -1
    site, stack = site_and_stack(f, node)
    region = f.under(np.isin(np.arange(len(f.tree)), f.action_nodes()[acts]))
    achieved = b / t if t else 0.0
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{int(page.sum() / per)} copies per step from pageable host memory ({b / per / 1e6:.0f} MB, "
               f"{ms(t / per)} at {achieved:.1f} GB/s) block the host"),
        mechanism=("Pageable memory is staged through a driver buffer: the copy runs far below the link's bandwidth "
                   "and the host waits for it, so nothing overlaps it."),
        remedy=(f"Allocate the host tensor in pinned memory once (tensor.pin_memory(), or DataLoader(pin_memory=True)) "
                f"and copy with .to(device, non_blocking=True) at {site or 'the copy'}; pinned copies run at "
                f"~{bw:.0f} GB/s ({bw_from}) and do not block the host."),
        place=Place("python" if site else "op", "Memcpy (Pageable)", site, stack),
        evidence={"copies": int(page.sum()), "bytes": b, "copy_us": t / 1e3, "achieved_gbps": achieved,
                  "pinned_gbps": bw, "pinned_from": bw_from},
        edit=e, region=region, claims=[Claim(EXPOSED_COPY, f.rank, t / 1e3)] + idle_claim(f, region))]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect,
                    acts_on=("gpu: memory ops", "host: cuda runtime"))
