"""STRAGGLER: one rank arrives last at the collectives and every other rank waits for it.

Mechanism: a collective completes only when the last rank arrives; a rank with more work
(input it loads on its own thread, extra kernels, a slower GPU or host) makes every other rank
wait at every collective. The waits are symptoms on the *other* ranks; the cause lives on the
straggler. Evidence: the cross-rank arrival analysis (who arrived last, how long the others
waited) and what the straggler's median step does more than the median rank's.

The straggler's own cause, when a detector found one on that rank (its data loading, say),
becomes the job's cause: priced by the joint replay, it claims the others' waits. Otherwise a
STRAGGLER cause is built from the difference: the straggler's extra kernels and host time
brought down to the median rank's, priced the same way.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP, PYTHON
from aiprof.diagnosis.causes.common import ms
from aiprof.diagnosis.detector import Detector, JobFacts, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import (
    EXPOSED_COMM,
    GPU_IDLE,
    MIN_REPORTED_SHARE,
    WAITING_RANK,
    Cause,
    Claim,
    Place,
    Symptom,
)

CODE = "STRAGGLER"
# A cause found on the straggler itself is its cause when it acts on the class of work in which
# the straggler differs most from the median rank, and its fix saves at least this share of what
# removing the whole difference saves.
PROMOTE_SHARE = 0.5


def _acts_on(code: str) -> tuple[str, ...]:
    """The classes of work the cause ``code``'s fix acts on (its detector's ``acts_on``)."""
    from aiprof.diagnosis.causes import REGISTRY  # here: the registry imports this module

    return next((d.acts_on for d in REGISTRY if d.code == code), ())


def _waiting_symptoms(ev: dict, by_rank: dict[int, RankFacts]) -> list[Symptom]:
    out = []
    s = ev["straggler_rank"]
    for w in ev.get("waiting_ranks", []):
        f = by_rank.get(w)
        if f is None:
            continue
        total = float(sum(b.duration_us for b in f.breakdown)) or 1.0
        # a wait longer than the window is impossible: an async collective issued early counts
        # from its issue; cap it at the rank's own analysed time
        waited = min(float(ev.get("waited_us", {}).get(str(w), 0.0)), total)
        n = max(len(f.breakdown), 1)
        out.append(Symptom(WAITING_RANK, w, f"rank {w} waits {waited / n / 1000.0:.1f} ms per step at collectives "
                                            f"for rank {s}", waited, waited / n, waited / total,
                           {"straggler_rank": s}))
    return out


def _diff_edit(f: RankFacts, ev: dict):
    """The straggler's extra kernels and extra host time (vs the median rank) removed."""
    g = f.graph
    e = f.edit(CODE)
    d = ev.get("differs") or {}
    per = max(len(f.steps), 1)
    k = f.rt.kernels
    what = []
    if g.n_ops and len(k):
        names = k.strings("name")
        kern = g.o_table == 0
        codes = np.full(g.n_ops, -1, np.int64)
        codes[kern] = names.codes[g.o_row[kern]]
        for item in d.get("kernels", []):
            if item.get("delta_us", 0) <= 0 or item.get("cls") not in ("compute", "memop"):
                continue
            try:
                c = names.labels.index(item["name"])
            except ValueError:
                continue
            m = codes == c
            per_step = float(g.o_dur[m].sum()) / per / 1e3
            if per_step <= 0:
                continue
            keep = max(0.0, (per_step - item["delta_us"]) / per_step)
            e.op_dur[m] = g.o_dur[m] * keep
            what.append(f"{item['name'][:60]} (+{item['delta_calls']} calls, +{ms(item['delta_us'] * 1e3)})")
    for item in d.get("functions", []):
        if item.get("delta_us", 0) <= 0 or item.get("kind") not in ("python", "op"):
            continue
        mask = f.node_mask(lambda s, n=item["name"]: s == n, (PYTHON, OP))
        if not mask.any():
            continue
        inside = float((f.tree.end[mask] - f.tree.start[mask]).sum()) / per / 1e3
        if inside <= 0:
            continue
        frac = min(1.0, item["delta_us"] / inside)
        e.gap_remove += f.gap_time_in(f.union_of_nodes(mask)) * frac
        what.append(f"{item['name'][:60]} (+{ms(item['delta_us'] * 1e3)})")
        break  # the outermost differing function; its children are inside it
    return e, what


def causes(facts: list[RankFacts], cross: dict, found: list[Cause], pricer) -> tuple[list[Cause], list[Symptom]]:
    """The straggler's cause (an existing one promoted, or one built from the difference), and
    the waiting ranks' WAITING_RANK symptoms."""
    by_rank = {f.rank: f for f in facts}
    out_c: list[Cause] = []
    out_s: list[Symptom] = []
    for ev in cross.get("stragglers", []):
        s = ev["straggler_rank"]
        f = by_rank.get(s)
        if f is None:
            continue
        waits = _waiting_symptoms(ev, by_rank)
        out_s += waits
        claims = [Claim(WAITING_RANK, w.rank, w.us) for w in waits]
        for w in waits:
            fw = by_rank[w.rank]
            comm = min(float(sum(b.communication_us for b in fw.breakdown)), w.us)
            if comm > 0:
                claims.append(Claim(EXPOSED_COMM, w.rank, comm))
            # the rest of the wait is GPU idle (a host-side collective, or a rank whose host
            # blocks on the collective's result)
            idle = min(float(sum(b.idle_us for b in fw.breakdown)), w.us - comm)
            if idle > 0:
                claims.append(Claim(GPU_IDLE, w.rank, idle))
        own = sorted((c for c in found if c.rank == s and c.saving.get("share", 0.0) >= MIN_REPORTED_SHARE),
                     key=lambda c: -c.saving.get("per_step_us", 0.0))
        info = {"rank": s, "waiting_ranks": ev.get("waiting_ranks", []), "last_arrivals": ev.get("last_arrivals"),
                "collectives": ev.get("collectives"), "caused_wait_per_step_us": ev.get("caused_wait_per_step_us"),
                "by_class": ev.get("by_class", [])[:3], "missing_ranks": ev.get("missing_ranks", [])}
        wr = ", ".join(str(w) for w in ev.get("waiting_ranks", [])[:6]) or "the others"
        cls = (ev.get("by_class") or [{}])[0].get("cls", "")
        e, what = _diff_edit(f, ev)
        c = Cause(
            code=CODE, rank=s,
            title=(f"rank {s} is the straggler: last at {ev.get('last_arrivals')} of {ev.get('collectives')} collectives, "
                   f"rank(s) {wr} wait for it" + (f"; it does more {cls}" if cls else "")
                   + (f": {', '.join(what[:2])}" if what else "")),
            mechanism=("A collective completes only when the last rank arrives: every other rank waits at each "
                       "collective for as long as this rank is late."),
            remedy=("Balance the work across ranks: remove rank-specific work from the step (logging, evaluation, "
                    "checkpointing, extra computation on one rank), give every rank the same batch shapes and sequence "
                    "lengths; if the work is the same, check that GPU's clocks, temperature and errors (nvidia-smi) "
                    "and the host's load."),
            place=Place("rank", f"rank {s}", "", [], []),
            evidence={"straggler": info, "differs": ev.get("differs", {})}, edit=e, claims=claims)
        pricer.price(f, c)
        # no exemption from the report floor: a healthy job has a last arriver at every collective
        # (someone is always last), and a "straggler" whose fix saves nothing is noise; its waits
        # stay WAITING_RANK symptoms, shown as unexplained when they matter (ORPHAN_MIN_SHARE)
        # a cause a detector found on the straggler is the better answer when it explains at
        # least half of what bringing the straggler to the median rank would save
        own = [o for o in own if cls in _acts_on(o.code)]
        if own and own[0].saving.get("per_step_us", 0.0) >= PROMOTE_SHARE * c.saving.get("per_step_us", 0.0):
            o = own[0]
            o.title = f"rank {s} is the straggler (rank(s) {wr} wait for it): {o.title}"
            o.evidence["straggler"] = info
            o.claims += claims
            continue
        out_c.append(c)
    return out_c, out_s


def detect(job: JobFacts) -> list[Cause]:
    return causes(job.facts, job.cross or {}, job.found, job.pricer)[0]


def waiting(job: JobFacts) -> list[Symptom]:
    """The WAITING_RANK symptoms of the ranks that wait for a straggler in hand."""
    by_rank = {f.rank: f for f in job.facts}
    return [w for ev in (job.cross or {}).get("stragglers", []) if ev["straggler_rank"] in by_rank
            for w in _waiting_symptoms(ev, by_rank)]


DETECTOR = Detector(CODE, Scope.CROSS_RANK, reads=("facts", "pricer", "cross", "found"), detect=detect,
                    symptoms=waiting)
