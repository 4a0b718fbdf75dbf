"""STRAGGLER: one rank arrives last at the collectives and every other rank waits for it.

Mechanism: a collective completes only when the last rank arrives; a rank with more work
(input it loads on its own thread, extra kernels, a slower GPU or host) makes every other rank
wait at every collective. The waits are symptoms on the *other* ranks; the cause lives on the
straggler. Evidence: the cross-rank arrival analysis (who arrived last, how long the others
waited) and what the straggler's median step does more than the median rank's.

The straggler's own cause, when a detector found one on that rank (its data loading, say),
becomes the job's cause: priced by the joint replay, it claims the others' waits. Otherwise a
STRAGGLER cause is built from the difference, named by what explains most of the wait
(:func:`explain`): larger inputs (the same ops on larger input shapes), a slower device (the same
work on the same inputs taking longer), extra kernels or an extra host function; or, when none
does, what differs, said plainly. Priced by the joint replay of the straggler's extra brought
down to the median rank's: the ops on larger inputs at the median rank's time, or its extra
kernels and host time.
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
# A difference is named as the reason for the wait when it accounts for at least this share of
# the wait the straggler caused per step, and more than any other difference: below it the
# difference is real but most of the wait comes from elsewhere, and the cause says what differs
# without naming a reason.
MIN_EXPLAINED_SHARE = 0.25
# The same work on the same inputs is "slower" on the straggler from this ratio of its time to
# the same calls at the median rank's time per call: the same kernels or ops on one device
# spread by a few percent from run to run; a tenth is beyond that.
SLOWER_MIN_RATIO = 1.10


def _alone_us(c: Cause) -> float:
    """What a cause's fix saves per step by itself (the engine's joint pricing keeps it)."""
    return c.saving.get("alone_us", c.saving.get("per_step_us", 0.0))


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


def _shape_nodes(f: RankFacts, edit: list) -> np.ndarray:
    """The straggler's op nodes whose name and input dims are among ``edit``'s (op, dims) pairs."""
    o = f.rt.ops
    tree = f.tree
    if not len(tree) or not len(o) or "input_dims" not in o or not edit:
        return np.zeros(len(tree), dtype=bool)
    dims = o.strings("input_dims")
    want_dims = {d: i for i, d in enumerate(dims.labels)}
    code_of = {}
    for c in np.unique(tree.code[tree.kind == OP]).tolist():
        code_of.setdefault(tree.labels[c], []).append(c)
    nd = len(dims.labels) + 1
    keys = [c * nd + want_dims[d] for name, d, *_ in edit if d in want_dims for c in code_of.get(name, [])]
    ops = tree.kind == OP
    key = np.full(len(tree), -1, np.int64)
    key[ops] = tree.code[ops] * nd + dims.codes[tree.row[ops]]
    return ops & np.isin(key, np.asarray(keys, dtype=np.int64))


def _inputs_edit(f: RankFacts, e, d: dict, per: int):
    """The straggler's ops on larger inputs at the median rank's time: the kernels each one
    launched scaled by the base rank's GPU time over the straggler's for that op and shape, and
    the excess of their host time out of the lane."""
    g = f.graph
    edit = (d.get("shapes") or {}).get("edit", [])
    for item in edit:
        scale = item[4] if len(item) > 4 else None
        if scale is None or not 0.0 <= scale < 1.0 or not g.n_ops:
            continue
        acts = f.actions_in(f.under(_shape_nodes(f, [item])))
        ops = acts[g.o_action] & (g.o_table == 0)
        if ops.any():
            e.op_dur[ops] = np.fmin(e.op_dur[ops], g.o_dur[ops] * scale)
    host = [x for x in edit if x[2] > 0]
    mask = _shape_nodes(f, host)
    if mask.any():
        u = f.union_of_nodes(mask)
        inside = float(u.total) / per / 1e3
        if inside > 0:
            e.gap_remove += f.gap_time_in(u) * min(1.0, sum(x[2] for x in host) / inside)
    return e


def _diff_edit(f: RankFacts, ev: dict, kind: str = ""):
    """The straggler's extra brought down to the median rank's: its extra kernels, and its ops
    on larger inputs at the median rank's time (``kind`` "inputs") or else the extra host time of
    its most different function."""
    g = f.graph
    e = f.edit(CODE)
    d = ev.get("differs") or {}
    per = max(len(f.steps), 1)
    k = f.rt.kernels
    what: list[str] = []
    if kind == "inputs":
        return _inputs_edit(f, e, d, per), what
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


def _on(ev: dict, base: int) -> str:
    """How the title names the ranks compared with: the base rank, the median one when more wait."""
    return f"rank {base}" if len(ev.get("waiting_ranks", [])) <= 1 else f"rank {base} (the median rank)"


def explain(ev: dict) -> dict:
    """What differs on the straggler that explains the wait it caused: ``{"kind", "us" (per
    step), "text", "remedy"}``, kind one of ``inputs`` (the same ops on larger input shapes),
    ``slower`` (the same work on the same inputs, slower), ``extra kernels``, ``extra host
    function`` — the largest, when it accounts for MIN_EXPLAINED_SHARE of the wait — or
    ``unexplained``, whose text says what differs and no more."""
    d = ev.get("differs") or {}
    s, b = ev["straggler_rank"], ev.get("base_rank")
    wait = float(ev.get("caused_wait_per_step_us") or 0.0)
    on = _on(ev, b)
    sh = d.get("shapes") or {}
    sp = d.get("speed") or {}
    cands = []
    first = sh.get("first")
    if first and (first.get("ratio") or 0.0) > 1.0 and sh.get("larger_delta_us", 0.0) > 0:
        dim = (f" (dimension {first['dim']}: {first['rank_size']} vs {first['base_size']})"
               if first.get("dim") is not None else "")
        ratio = f", {first['ratio']:.1f}× the elements" if first.get("ratio") else ""
        text = (f"rank {s}'s inputs are larger: {first['op']} gets {first['rank_shape']} on rank {s} vs "
                f"{first['base_shape']} on {on}{ratio}; its ops on larger inputs take "
                f"+{ms(sh['larger_delta_us'] * 1e3)} per step")
        remedy = (f"Give every rank inputs of the same size: the same sequence lengths and batch sizes (bucket or "
                  f"pad to a common length, or balance tokens per rank). Rank {s}'s {first['op']} gets "
                  f"{first['rank_shape']} against {first['base_shape']}{dim}.")
        cands.append(("inputs", float(sh["larger_delta_us"]), text, remedy))
    if sp and sp.get("ratio", 0.0) >= SLOWER_MIN_RATIO and sp.get("extra_us", 0.0) > 0:
        gpu = sp.get("device") == "gpu"
        clk = ((d.get("clocks") or {}).get("sm_clock_mhz") or {})
        clock = (f"; SM clock {clk['rank']:.0f} vs {clk['base']:.0f} MHz"
                 if clk.get("rank") is not None and clk.get("base") is not None else "")
        text = (f"rank {s} runs the same {'kernels' if gpu else 'ops'} on the same inputs {sp['ratio']:.2f}× slower "
                f"than {on} (+{ms(sp['extra_us'] * 1e3)} per step){clock}")
        remedy = (f"The work is the same on every rank; rank {s}'s GPU runs it slower: check its clocks, temperature, "
                  f"power limit and errors (nvidia-smi -q -d CLOCK,TEMPERATURE,POWER,PERFORMANCE: the throttle "
                  f"reasons), or move the job off that GPU." if gpu else
                  f"The work is the same on every rank; rank {s}'s host runs it slower: check what else runs on its "
                  f"cores (other processes, threads pinned to the same cores, CPU frequency scaling) and give each "
                  f"rank cores of its own.")
        cands.append(("slower", float(sp["extra_us"]), text, remedy))
    extra = [x for x in d.get("kernels", []) if x.get("delta_calls", 0) > 0 and x.get("delta_us", 0) > 0]
    if extra:
        us = float(sum(x["delta_us"] for x in extra))
        listed = ", ".join(f"{x['name'][:60]} (+{x['delta_calls']} calls, +{ms(x['delta_us'] * 1e3)})"
                           for x in extra[:2])
        cands.append(("extra kernels", us, f"it runs kernels the others do not: {listed}",
                      f"Rank {s} runs work the others do not: {listed} per step. Remove it from that rank's step, or "
                      f"spread it over every rank."))
    fn = next((x for x in d.get("functions", []) if x.get("kind") in ("python", "op") and x.get("delta_us", 0) > 0
               and (x.get("delta_calls", 0) > 0 or x.get("base_calls", 1) == 0)), None)
    if fn:
        n = fn["delta_calls"]
        calls = f", {n} more call{'s' if n != 1 else ''}" if n > 0 else ""
        cands.append(("extra host function", float(fn["delta_us"]),
                      f"it spends +{ms(fn['delta_us'] * 1e3)} per step in {fn['name'][:80]}{calls}",
                      f"Rank {s} runs {fn['name'][:80]} where the others do not, or more often: remove it from the "
                      f"step, run it every N steps, or spread it over the ranks."))
    order = {"inputs": 0, "slower": 1, "extra kernels": 2, "extra host function": 3}
    best = min(cands, key=lambda c: (-c[1], order[c[0]])) if cands else None
    if best and best[1] >= MIN_EXPLAINED_SHARE * wait:
        return {"kind": best[0], "us": best[1], "text": best[2], "remedy": best[3]}
    # no difference accounts for the wait: say what differs, and what would tell more
    differs = [c[2] for c in sorted(cands, key=lambda c: -c[1])[:2]]
    if not differs:  # the same calls, some longer: the largest such difference
        top = max((x for x in d.get("kernels", []) + d.get("functions", []) if x.get("delta_us", 0) > 0
                   and x.get("delta_calls", 0) == 0),
                  key=lambda x: x["delta_us"], default=None)
        if top:
            differs.append(f"{top['name'][:80]} takes +{ms(top['delta_us'] * 1e3)} per step with as many calls")
    coll = d.get("collectives") or {}
    if coll.get("differ"):
        t = coll["differ"][0]
        r, bb = coll["rank"].get(t, {}), coll["base"].get(t, {})
        differs.append(f"its {t} collectives: {r.get('calls', 0):g} calls of {r.get('size', 0):.0f} {coll['unit']} "
                       f"per step vs {bb.get('calls', 0):g} of {bb.get('size', 0):.0f} on rank {b}")
    hint = ("" if sh.get("recorded") else " `aiprof run --what shapes` records the ops' input shapes, which would "
            "compare the ranks' inputs.")
    remedy = (f"The recorded work does not show why rank {s} is late: "
              + ("; ".join(differs) if differs else "no kernel or host function of its median step takes longer")
              + f". Make the ranks' work the same.{hint}")
    return {"kind": "unexplained", "us": 0.0, "text": "; ".join(differs), "remedy": remedy}


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
        # compared by what each saves by itself (the straggler's fix is priced alone too), not by
        # what it adds to the rank's other fixes
        own = sorted((c for c in found if c.rank == s and c.saving.get("share", 0.0) >= MIN_REPORTED_SHARE),
                     key=lambda c: -_alone_us(c))
        info = {"rank": s, "waiting_ranks": ev.get("waiting_ranks", []), "last_arrivals": ev.get("last_arrivals"),
                "collectives": ev.get("collectives"), "caused_wait_per_step_us": ev.get("caused_wait_per_step_us"),
                "by_class": ev.get("by_class", [])[:3], "missing_ranks": ev.get("missing_ranks", [])}
        wr = ", ".join(str(w) for w in ev.get("waiting_ranks", [])[:6]) or "the others"
        cls = (ev.get("by_class") or [{}])[0].get("cls", "")
        why = explain(ev)
        e, what = _diff_edit(f, ev, why["kind"])
        head = (f"rank {s} is the straggler: last at {ev.get('last_arrivals')} of {ev.get('collectives')} collectives, "
                f"rank(s) {wr} wait for it")
        if why["kind"] in ("inputs", "slower", "extra host function"):
            title = f"{head}; {why['text']}"
        else:  # what it does more of, as measured (the extra kernels, the most different function)
            title = (head + (f"; it does more {cls}" if cls else "") + (f": {', '.join(what[:2])}" if what else "")
                     + (f"; {why['text']}" if why["kind"] == "unexplained" and why["text"] and not what else ""))
        c = Cause(
            code=CODE, rank=s, title=title,
            mechanism=("A collective completes only when the last rank arrives: every other rank waits at each "
                       "collective for as long as this rank is late."),
            remedy=why["remedy"],
            place=Place("rank", f"rank {s}", "", [], []),
            evidence={"straggler": info, "differs": ev.get("differs", {}),
                      "difference": {k: why[k] for k in ("kind", "us", "text")}}, edit=e, claims=claims)
        pricer.price(f, c)
        # no exemption from the report floor: a healthy job has a last arriver at every collective
        # (someone is always last), and a "straggler" whose fix saves nothing is noise; its waits
        # stay WAITING_RANK symptoms, shown as unexplained when they matter (ORPHAN_MIN_SHARE)
        # a cause a detector found on the straggler is the better answer when it explains at
        # least half of what bringing the straggler to the median rank would save
        own = [o for o in own if cls in _acts_on(o.code)]
        if own and _alone_us(own[0]) >= PROMOTE_SHARE * c.saving.get("per_step_us", 0.0):
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
