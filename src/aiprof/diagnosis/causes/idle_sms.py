"""SM_ARRAY_IDLE: kernels that keep most of the GPU's SMs idle while they run.

Mechanism: a kernel whose grid has fewer thread blocks than the GPU has SMs (a small batch, a
reduction into few outputs, a serial tail of a split kernel) leaves the other SMs with nothing
to do: its duration is set by the busy few. The GPU's own counters show it directly: PM
sampling's ``sm__cycles_active`` (share of SMs with work, per ~100 µs sample) stays low while
the kernels run, which the kernel trace alone cannot tell from a kernel that is merely slow.

Evidence: a compute kernel family whose kernels fill most of the sample windows they appear in
(coverage >= ``MIN_COVERAGE_PCT``, so the counters are the family's own) with SM-active below
``analysis.counters.IDLE_SM_PCT``. Fix priced: the family's kernels spread over every SM, i.e.
each kernel's duration times the SM-active share (work-conserving: the same SM-time on all
SMs), an upper bound on what more parallelism can save.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.counters import IDLE_SM_PCT
from aiprof.analysis.kernels import kernel_family
from aiprof.diagnosis.causes.common import ms
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "SM_ARRAY_IDLE"
#: The family must fill at least this share of the sample windows it touches, else the counters
#: are a blend with its neighbours' and say little about it.
MIN_COVERAGE_PCT = 50.0
#: SM-active is never taken below this when pricing: a reading near zero is a kernel shorter
#: than the sampler can resolve, not a kernel that could run 100x faster.
MIN_ACTIVE_FOR_PRICING_PCT = 5.0


def detect(f: RankFacts) -> list[Cause]:
    cnt = f.counters
    if cnt is None or not cnt.families or not len(f.rt.kernels):
        return []
    g = f.graph
    k = f.rt.kernels
    names = k.strings("name")
    fam_of_label = np.array([kernel_family(s) for s in names.labels] + [""], dtype=object)
    kern = g.o_table == 0
    out = []
    per = max(len(f.steps), 1)
    for fam in cnt.families:
        sm = fam["counters"].get("pm_sm_active_pct")
        if sm is None or sm >= IDLE_SM_PCT or fam["coverage_pct"] < MIN_COVERAGE_PCT:
            continue
        sel = np.zeros(g.n_ops, dtype=bool)
        sel[kern] = fam_of_label[names.codes[g.o_row[kern]]] == fam["family"]
        if not sel.any():
            continue
        share = max(sm, MIN_ACTIVE_FOR_PRICING_PCT) / 100.0
        e = f.edit(CODE)
        e.op_dur[sel] = g.o_dur[sel] * share
        fam_ns = float(g.o_dur[sel].sum())
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"{ms(fam_ns / per)} per step in {fam['family'][:60]} kernels that keep {100 - sm:.0f}% of the SMs "
                   f"idle (SM active {sm:.0f}% while they run)"),
            mechanism=("These kernels launch too few thread blocks to occupy every SM, so their duration is set by the "
                       "busy few while the rest of the GPU waits; the GPU's PM counters show the SM array mostly idle "
                       "during them."),
            remedy=("Give the kernels more parallelism: a larger batch or sequence per launch, fusing small launches "
                    "(torch.compile), a split-K/stream-K GEMM or a different reduction layout for the op that launches "
                    "them; if they are small by nature, overlap them with other work on another CUDA stream."),
            place=Place("kernel", fam["family"], "", [], []),
            evidence={"sm_active_pct": sm, "coverage_pct": fam["coverage_pct"], "kernels": fam["kernels"],
                      "sampled_us": fam["sampled_us"], "bound": fam["bound"],
                      "tensor_active_pct": fam["counters"].get("pm_tensor_active_pct"),
                      "dram_pct_of_peak": fam.get("dram_pct_of_peak"), "speedup_assumed": 1 / share},
            edit=e, claims=[Claim(SLOW_KERNELS, f.rank, fam_ns / 1e3 * (1 - share))]))
    return out
