"""Findings: rules over the analyses, each with a stable code, severity, evidence, a specific
suggestion and ``impact_us`` (the time fixing it could save over the analysed steps).

Every rule, threshold and impact formula is documented in docs/findings.md; the thresholds are
the named constants below, except the cross-rank ones (STRAGGLER_RANK, ABNORMAL_WORKER), which
live with their detection in analysis/ranks.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof.analysis.breakdown import StepBreakdown
from aiprof.analysis.comm import CommAnalysis
from aiprof.analysis.diff import StepDiff
from aiprof.analysis.hotspots import HOST_CLASSES, Gaps, HostTree, is_data_loading
from aiprof.analysis.kernels import KernelAnalysis
from aiprof.analysis.runtime import RuntimeAnalysis, is_scalar_read
from aiprof.trace import classify

HIGH, MEDIUM, LOW = "high", "medium", "low"
# Findings about the job as a whole (they name one rank, but every rank's view should show them).
JOB_WIDE_CODES = frozenset({"STRAGGLER_RANK", "ABNORMAL_WORKER", "HANG"})

# STEP_OUTLIER
STEP_OUTLIER_MIN_STEPS = 3  # a median needs a few steps
STEP_OUTLIER_RATIO = 1.3  # step / median
STEP_OUTLIER_MIN_US = 5_000.0  # and at least this much slower
STEP_OUTLIER_HIGH_RATIO = 1.5  # high needs this ratio and this much extra time
STEP_OUTLIER_HIGH_MIN_US = 20_000.0
STEP_OUTLIER_MAD_K = 5.0  # and beyond this many median absolute deviations (noise guard)
STEP_OUTLIER_MAX_SEPARATE = 3  # more outlier steps than this are reported as one recurring finding
STEP_OUTLIER_MAX_LISTED = 50  # outlier step numbers kept in the evidence
# DATA_LOADING (share = GPU idle while loading / summed step time)
DATA_LOADING_MIN_US = 1_000.0
DATA_LOADING_MIN_SHARE = 0.03
DATA_LOADING_MEDIUM_SHARE = 0.05
DATA_LOADING_HIGH_SHARE = 0.15
# GPU_IDLE_HOST_BOUND (share = GPU idle while the host runs Python, op dispatch or launches)
HOST_BOUND_MIN_SHARE = 0.10
HOST_BOUND_MEDIUM_SHARE = 0.15
HOST_BOUND_HIGH_SHARE = 0.35
SHORT_KERNEL_US = 20.0  # median kernel shorter than this: launch overhead matters
# Share of the host-bound idle time that CUDA graphs / torch.compile are assumed to recover (an
# assumption, not a measurement: Python/dispatch work that stays on the host keeps part of it)
HOST_BOUND_RECOVERABLE = 0.5
# SYNC_STALL (share = stall / summed step time)
SYNC_MIN_US = 1_000.0
SYNC_MIN_SHARE = 0.01
SYNC_MEDIUM_SHARE = 0.03
SYNC_HIGH_SHARE = 0.10
# COMM_EXPOSED (share = exposed communication / summed step time)
COMM_MIN_SHARE = 0.05
COMM_HIGH_SHARE = 0.20
# MEMCPY_PAGEABLE
PAGEABLE_MIN_US = 500.0
PAGEABLE_MEDIUM_SHARE = 0.05
PAGEABLE_SAVING = 0.5  # pinned copies run about twice as fast and can overlap compute
# LOW_TENSOR_CORE (share of matmul GPU time)
LOW_TC_MIN_SHARE = 0.10
LOW_TC_MIN_US = 1_000.0
LOW_TC_HIGH_SHARE_OF_COMPUTE = 0.30
LOW_TC_ASSUMED_SPEEDUP = 2.0  # conservative: bf16/tf32 tensor cores vs fp32 CUDA cores
LOW_TC_HIGH_MIN_STEP_SHARE = 0.05  # high only if the saving is >= 5 % of step time
LOW_TC_MEDIUM_MIN_STEP_SHARE = 0.01  # below 1 % of step time: low
# KERNEL_HOTSPOT (share of GPU compute time)
HOTSPOT_MIN_SHARE = 0.40
HOTSPOT_MEDIUM_SHARE = 0.60
HOTSPOT_ASSUMED_GAIN = 0.10  # impact: a 10 % speed-up of the family


@dataclass
class RankFacts:
    """What the rules read about one rank (built by analysis.report)."""

    rank: int
    steps: list[StepBreakdown]
    gaps: Gaps
    tree: HostTree
    step_numbers: np.ndarray
    host_idle_by_class: dict  # class -> µs over the steps (HOST_CLASSES)
    diff: StepDiff | None
    runtime: RuntimeAnalysis
    kernels: KernelAnalysis
    comm: CommAnalysis
    pageable: dict  # {"count","bytes","dur_us","by_kind": {...}}
    has_gpu: bool
    extra: dict = field(default_factory=dict)  # cross-rank context, filled by the report


def _f(code, severity, title, rank, step, where, impact_us, evidence, suggestion) -> dict:
    return {"code": code, "severity": severity, "title": title, "rank": rank, "step": step, "where": where,
            "impact_us": float(impact_us), "evidence": evidence, "suggestion": suggestion}


def _ms(us: float) -> str:
    return f"{us / 1000.0:.1f} ms"


def _total_us(f: RankFacts) -> float:
    return float(sum(s.duration_us for s in f.steps)) or 1.0


def step_outlier(f: RankFacts) -> list[dict]:
    if len(f.steps) < STEP_OUTLIER_MIN_STEPS:
        return []
    d = np.array([s.duration_us for s in f.steps])
    med = float(np.median(d))
    mad = float(np.median(np.abs(d - med)))
    outliers = [s for s in f.steps
                if not (s.duration_us < STEP_OUTLIER_RATIO * med or s.duration_us - med < STEP_OUTLIER_MIN_US
                        or s.duration_us - med < STEP_OUTLIER_MAD_K * mad)]
    if len(outliers) <= STEP_OUTLIER_MAX_SEPARATE:
        return [_step_outlier_finding(f, s, med, mad, [s]) for s in outliers]
    # A recurring slow step (every Nth step: checkpointing, eval, a periodic stall) is one
    # problem: one finding for the worst step, whose impact is the extra time of them all.
    worst = max(outliers, key=lambda s: s.duration_us)
    return [_step_outlier_finding(f, worst, med, mad, outliers)]


def _step_outlier_finding(f: RankFacts, s: StepBreakdown, med: float, mad: float, group: list) -> dict:
    extra = s.duration_us - med
    total_extra = float(sum(g.duration_us - med for g in group))
    cause, where, sugg = "", "", ""
    if f.diff is not None and f.diff.compare["step"] == s.step and f.diff.items:
        top = f.diff.items[0]
        where = _where(top)
        cause = _describe(top, extra, f.has_gpu)
        sugg = _fix_for(top, f)
    ratio = s.duration_us / med
    title = f"step {s.step} took {_ms(s.duration_us)}, {ratio:.2f}x the median {_ms(med)}"
    evidence = {"step_us": s.duration_us, "median_us": med, "mad_us": mad, "extra_us": extra,
                "root_items": [_item_ev(i) for i in (f.diff.items[:5] if f.diff and f.diff.compare["step"] == s.step else [])]}
    saving = f" Expected saving: up to {_ms(extra)} on this step."
    if len(group) > 1:
        nums = [g.step for g in group]
        gaps = set(np.diff(nums).tolist())
        period = f", every {gaps.pop()} steps" if len(gaps) == 1 else ""
        title = f"{len(group)} of {len(f.steps)} steps are outliers{period}; worst: " + title
        evidence.update({"outlier_steps": nums[:STEP_OUTLIER_MAX_LISTED], "outliers": len(group),
                         "total_extra_us": total_extra})
        saving = (f" The step diff is of the worst one; if the others share its cause, fixing it saves up to "
                  f"{_ms(total_extra)} over the {len(group)} steps.")
    return _f(
        "STEP_OUTLIER", HIGH if ratio >= STEP_OUTLIER_HIGH_RATIO and extra >= STEP_OUTLIER_HIGH_MIN_US else MEDIUM,
        title, f.rank, s.step, where, total_extra, evidence,
        (f"{cause}. {sugg.rstrip('.')}." if cause else "Compare it with `aiprof diff` to see what the extra time went to.")
        + saving)


def _item_ev(i) -> dict:
    return {"kind": i.kind, "name": i.name, "delta_us": i.delta_us, "delta_calls": i.delta_calls,
            "host_kind": i.host_kind, "stack": i.stack[-4:], "site": i.site}


def _where(item) -> str:
    if item.kind == "gap":
        chain = [s for s in item.stack[-3:]]
        if item.host_kind != "python" and item.name not in chain:
            chain.append(item.name)
        return " > ".join(chain) if chain else item.name
    return item.name


def _describe(item, extra: float, gpu: bool = True) -> str:
    share = 100.0 * item.delta_us / extra if extra else 0.0
    if item.kind == "gap":
        where = f" (called from {item.site})" if item.site and item.site not in item.name else ""
        what = "GPU idle while the host was in" if gpu else "host time in"
        return f"{_ms(item.delta_us)} ({share:.0f}% of the extra time) is {what} {item.name}{where}"
    return f"{_ms(item.delta_us)} ({share:.0f}%) is extra GPU time in {item.kind} {item.name[:80]} ({item.delta_calls:+d} calls)"


def _fix_for(item, f: RankFacts) -> str:
    if item.kind != "gap":
        return "Check why this kernel ran longer or more often in this step (input shapes, extra work)."
    chain = " ".join(item.stack).lower() + " " + item.name.lower()
    if any(is_data_loading(s) for s in item.stack + [item.name]):
        waiter = "The GPU waits" if f.has_gpu else "The step waits"
        return (f"{waiter} for input: prefetch the next batch while the step computes (DataLoader with "
                "num_workers>0, pin_memory=True, prefetch_factor), or remove the blocking work from "
                f"{item.site or item.name}")
    if "sleep" in chain:
        return f"The host sleeps inside the step: remove the sleep in {item.site or item.name} or move it off the training loop"
    if classify.is_sync_call(item.name) or "synchronize" in chain:
        return f"The host is blocked on a GPU synchronisation: remove it from {item.site or 'the loop'}"
    return f"Make {item.site or item.name} cheaper or move it out of the step (the GPU has nothing queued meanwhile)"


def data_loading(f: RankFacts) -> list[dict]:
    if not f.has_gpu or not len(f.gaps.start):
        return []
    m = f.gaps.loading
    total = float(f.gaps.dur[m].sum()) / 1000.0
    share = total / _total_us(f)
    if total < DATA_LOADING_MIN_US or share < DATA_LOADING_MIN_SHARE:
        return []
    per_step = np.bincount(f.gaps.step[m], weights=f.gaps.dur[m], minlength=len(f.steps)) / 1000.0
    worst = int(np.argmax(per_step))
    # the loading function: the outermost data-loading ancestor of the largest loading gap
    big = int(np.argmax(np.where(m, f.gaps.dur, -1)))
    node = int(f.gaps.node[big])
    fn, inner = "", ""
    if node >= 0:
        chain = f.tree.ancestors(node)
        loaders = [n for n in chain if is_data_loading(f.tree.name(n))]
        fn = f.tree.name(loaders[-1]) if loaders else f.tree.name(node)
        inner = f.tree.name(node)
    sev = HIGH if share >= DATA_LOADING_HIGH_SHARE else MEDIUM if share >= DATA_LOADING_MEDIUM_SHARE else LOW
    under = f", mostly in {inner} under it" if inner and inner != fn else ""
    return [_f("DATA_LOADING", sev, f"GPU idle {_ms(total)} ({100 * share:.1f}%) while the host loads input in {fn}",
               f.rank, int(f.step_numbers[worst]), fn + (f" > {inner}" if inner and inner != fn else ""), total,
               {"idle_while_loading_us": total, "share": share,
                "per_step_us": {int(n): float(v) for n, v in zip(f.step_numbers, per_step)},
                "function": fn, "innermost": inner},
               f"The GPU waited for {fn}{under} (worst: step {int(f.step_numbers[worst])}, {_ms(per_step[worst])}). "
               "Load the next batch while the GPU works: a DataLoader with num_workers>0, pin_memory=True and "
               "prefetch, or a background prefetch thread/stream; keep slow I/O out of the step. "
               f"Expected saving: up to {_ms(total)}.")]


def host_bound(f: RankFacts) -> list[dict]:
    if not f.has_gpu:
        return []
    c = f.host_idle_by_class
    idle = c.get("host: python", 0.0) + c.get("host: op dispatch", 0.0) + c.get("host: cuda runtime", 0.0)
    share = idle / _total_us(f)
    if share < HOST_BOUND_MIN_SHARE:
        return []
    k = f.kernels
    short = k.median_kernel_us < SHORT_KERNEL_US
    sev = HIGH if share >= HOST_BOUND_HIGH_SHARE else MEDIUM if share >= HOST_BOUND_MEDIUM_SHARE else LOW
    tops = f.extra.get("host_idle_items", [])[:3]
    where = ", ".join(t["name"] for t in tops)
    saving = HOST_BOUND_RECOVERABLE * idle
    return [_f("GPU_IDLE_HOST_BOUND", sev,
               f"GPU idle {_ms(idle)} ({100 * share:.1f}%) while the host runs Python, op dispatch and kernel launches",
               f.rank, None, where, saving,
               {"idle_us": idle, "share": share, "launches_per_step": k.launches_per_step,
                "median_kernel_us": k.median_kernel_us, "by_class_us": {x: c.get(x, 0.0) for x in HOST_CLASSES[:3]},
                "top_host_items": tops},
               f"The GPU finishes work faster than the host queues it ({k.launches_per_step:.0f} launches/step, "
               f"median kernel {k.median_kernel_us:.1f} µs{', short' if short else ''}). Capture the step with CUDA "
               "graphs or torch.compile(mode='reduce-overhead'), fuse small ops, or raise the batch size; "
               f"host time while idle is led by {where or 'n/a'}. Expected saving: about {_ms(saving)} "
               f"(assuming {100 * HOST_BOUND_RECOVERABLE:.0f}% of the idle time is recovered; at most {_ms(idle)}).")]


def sync_stall(f: RankFacts) -> list[dict]:
    out = []
    total = _total_us(f)
    for s in f.runtime.syncs:
        share = s.stall_us / total
        if s.stall_us < SYNC_MIN_US or share < SYNC_MIN_SHARE:
            continue
        sev = HIGH if share >= SYNC_HIGH_SHARE else MEDIUM if share >= SYNC_MEDIUM_SHARE else LOW
        what = f"{s.call}" + (f" in {s.op}" if s.op else "")
        hint = (" It comes from a blocking copy or scalar read (`.item()`, `.cpu()`, `.tolist()`, `if tensor:`, or "
                "`.to()/.cuda()` of pageable memory): keep values on the GPU and read them every N steps, and copy "
                "inputs from pinned memory with non_blocking=True." if s.op and is_scalar_read(s.op) else
                " Remove the explicit synchronize from the loop (time with CUDA events instead), or do it every N steps.")
        out.append(_f("SYNC_STALL", sev, f"{s.calls} blocking {what} at {s.site or 'unknown site'} drain the GPU queue",
                      f.rank, s.steps[0] if len(s.steps) == 1 else None, " > ".join(s.stack[-3:]) or s.site,
                      s.stall_us,
                      {"call": s.call, "op": s.op, "site": s.site, "calls": s.calls, "host_wait_us": s.host_wait_us,
                       "gpu_idle_after_us": s.gpu_idle_after_us, "stall_us": s.stall_us, "steps": s.steps},
                      f"The host waited {_ms(s.host_wait_us)} in {what} and the GPU then idled {_ms(s.gpu_idle_after_us)} "
                      f"before new work arrived.{hint} Expected saving: up to {_ms(s.stall_us)}."))
    return out


def comm_exposed(f: RankFacts) -> list[dict]:
    if not f.has_gpu:
        return []
    exposed = float(sum(s.communication_us for s in f.steps))
    share = exposed / _total_us(f)
    if share < COMM_MIN_SHARE:
        return []
    by_type = f.comm.by_type
    worst = max(by_type, key=lambda t: by_type[t]["exposed_us"]) if by_type else ""
    strag = f.extra.get("straggler")
    ev = {"exposed_us": exposed, "share": share, "by_type": by_type, "link": f.comm.link,
          "per_step_us": {s.step: s.communication_us for s in f.steps}}
    if strag and strag["waiting_rank"] == f.rank:
        ev["straggler"] = strag
        extra = strag.get("extra_kernels") or []
        detail = (f"; rank {strag['straggler_rank']} runs extra GPU work: "
                  + ", ".join(f"{k['name'][:60]} ({k['delta_calls']:+d} calls, {_ms(k['delta_us'])})" for k in extra[:2])
                  if extra else "")
        sugg = (f"Rank {f.rank} waits {_ms(strag['wait_us'])} in {worst or 'collectives'} for rank "
                f"{strag['straggler_rank']}, which arrives last at the collectives and computes "
                f"{_ms(strag['compute_gap_us'])} longer{detail} (see STRAGGLER_RANK). "
                "Balance the work across ranks (same batch shapes, no rank-specific extra work); "
                f"expected saving: up to {_ms(min(exposed, strag['wait_us']))}.")
        title = f"rank {f.rank} waits {_ms(exposed)} ({100 * share:.1f}%) in exposed {worst or 'communication'} for straggler rank {strag['straggler_rank']}"
        impact = min(exposed, strag["wait_us"]) if strag["wait_us"] > 0 else exposed
    else:
        sugg = ("Overlap communication with compute: DDP bucketing (bucket_cap_mb), gradient accumulation with "
                "no_sync(), FSDP prefetch; check the link (bus bandwidth) and message sizes. "
                f"Expected saving: up to {_ms(exposed)}.")
        title = f"{_ms(exposed)} ({100 * share:.1f}%) of communication is not hidden behind compute"
        impact = exposed
    sev = HIGH if share >= COMM_HIGH_SHARE else MEDIUM
    return [_f("COMM_EXPOSED", sev, title, f.rank, None, worst, impact, ev, sugg)]


def memcpy_pageable(f: RankFacts) -> list[dict]:
    p = f.pageable
    if not p or p.get("dur_us", 0.0) < PAGEABLE_MIN_US:
        return []
    share = p["dur_us"] / _total_us(f)
    saving = PAGEABLE_SAVING * p["dur_us"]
    kinds = ", ".join(f"{k} {v['count']}x" for k, v in p.get("by_kind", {}).items())
    return [_f("MEMCPY_PAGEABLE", MEDIUM if share >= PAGEABLE_MEDIUM_SHARE else LOW,
               f"{p['count']} copies from/to pageable host memory take {_ms(p['dur_us'])}", f.rank, None,
               p.get("site", ""), saving, p,
               f"Copies {kinds} ({p['bytes'] / 1e6:.1f} MB) use pageable memory, which is staged and synchronous. "
               "Allocate host tensors with pin_memory=True (DataLoader(pin_memory=True) or tensor.pin_memory()) and copy "
               f"with .to(device, non_blocking=True). Expected saving: about {_ms(saving)}.")]


def low_tensor_core(f: RankFacts) -> list[dict]:
    k = f.kernels
    if not k.matmul_us:
        return []
    fp32_ops_us = float(sum(o["gpu_us"] for o in k.fp32_matmul_ops))
    slow = max(k.non_tc_matmul_us, fp32_ops_us)
    share = slow / k.matmul_us
    if share < LOW_TC_MIN_SHARE or slow < LOW_TC_MIN_US:
        return []
    saving = slow * (1.0 - 1.0 / LOW_TC_ASSUMED_SPEEDUP)
    # A share of matmul time alone over-ranks a host-bound job whose GPU barely works (eager
    # decoding): severity also weighs the saving against the step time.
    step_share = saving / _total_us(f)
    if slow >= LOW_TC_HIGH_SHARE_OF_COMPUTE * k.compute_us and step_share >= LOW_TC_HIGH_MIN_STEP_SHARE:
        sev = HIGH
    elif step_share >= LOW_TC_MEDIUM_MIN_STEP_SHARE:
        sev = MEDIUM
    else:
        sev = LOW
    ops = ", ".join(f"{o['op']} ({o['calls']} calls)" for o in k.fp32_matmul_ops[:3])
    where = ops or (k.non_tc_matmul_kernels[0][:80] if k.non_tc_matmul_kernels else "")
    return [_f("LOW_TENSOR_CORE", sev, f"{_ms(slow)} ({100 * share:.0f}% of matmul time) runs in fp32 or without tensor cores",
               f.rank, None, where, saving,
               {"matmul_us": k.matmul_us, "non_tc_matmul_us": k.non_tc_matmul_us, "fp32_matmul_ops": k.fp32_matmul_ops,
                "non_tc_kernels": k.non_tc_matmul_kernels, "precision_us": k.precision_us},
               "Run matmuls on tensor cores: torch.autocast(device_type='cuda', dtype=torch.bfloat16) around the "
               "forward pass, or at least torch.backends.cuda.matmul.allow_tf32 = True / "
               "torch.set_float32_matmul_precision('high')" + (f"; fp32 matmul ops: {ops}" if ops else "")
               + f". Expected saving: about {_ms(saving)} (assuming a {LOW_TC_ASSUMED_SPEEDUP:.0f}x speed-up).")]


def kernel_hotspot(f: RankFacts) -> list[dict]:
    k = f.kernels
    if not k.families:
        return []
    top = k.families[0]
    share = top["share_pct_of_compute"] / 100.0
    if share < HOTSPOT_MIN_SHARE:
        return []
    fam = top["family"]
    low = fam.lower()
    if any(w in low for w in ("elementwise", "reduce", "copy", "cat", "index")):
        hint = "memory-bound small ops: fuse them with torch.compile, or remove redundant copies/casts"
    elif any(w in low for w in ("sdpa", "flash", "attention", "fmha")):
        hint = "attention dominates: make sure the flash/cuDNN SDPA backend is used and sequence lengths are not padded"
    else:
        hint = "check its shapes (multiples of 64/128), its precision (bf16/fp8) and whether it is called more often than needed"
    return [_f("KERNEL_HOTSPOT", MEDIUM if share >= HOTSPOT_MEDIUM_SHARE else LOW,
               f"kernel family {fam[:60]} takes {100 * share:.0f}% of GPU compute time", f.rank, None, fam,
               HOTSPOT_ASSUMED_GAIN * top["total_us"], {"family": top, "families": k.families[:5]},
               f"{fam[:60]} runs {top['calls']} times for {_ms(top['total_us'])}: {hint}. "
               f"Impact shown: a {100 * HOTSPOT_ASSUMED_GAIN:.0f}% speed-up of this family "
               f"({_ms(HOTSPOT_ASSUMED_GAIN * top['total_us'])}).")]


def straggler_rank(cross: dict) -> list[dict]:
    """STRAGGLER_RANK: one finding per straggler found by analysis.ranks.cross_rank."""
    out = []
    from aiprof.analysis import ranks as rk

    for ev in cross.get("stragglers", []):
        r = ev["straggler_rank"]
        host = f" on {ev['host']}" if ev.get("host") else ""
        d = ev.get("differs") or {}
        causes = [f"{c['cls']} +{_ms(c['delta_per_step_us'])}/step ({_ms(c['rank_us'])} vs {_ms(c['median_us'])})"
                  for c in ev.get("by_class", [])[:2]]
        ks = d.get("kernels", [])
        kern = [f"{k['name'][:70]} ({k['delta_calls']:+d} calls, +{_ms(k['delta_us'])})" for k in ks[:3]
                if k["delta_us"] >= 0.25 * ks[0]["delta_us"]]
        fns = [f"{g['name'][:60]} (+{_ms(g['delta_us'])} GPU idle)" for g in d.get("host_gaps", [])[:1]]
        what = "; ".join(x for x in ("; ".join(causes), ", ".join(kern + fns)) if x)
        waiting = ev.get("waiting_ranks", [])
        wr = ", ".join(map(str, waiting[:6])) + (" …" if len(waiting) > 6 else "")
        share = ev.get("share_of_step", 0.0)
        sev = HIGH if share >= rk.STRAGGLER_HIGH_SHARE else MEDIUM
        miss = (f" Ranks missing from the capture: {', '.join(map(str, ev['missing_ranks'][:8]))}; "
                "one of them may be slower still." if ev.get("missing_ranks") else "")
        out.append(_f(
            "STRAGGLER_RANK", sev,
            f"rank {r}{host} is the straggler: last at {ev['last_arrivals']} of {ev['collectives']} collectives, "
            f"the others wait {_ms(ev['caused_wait_per_step_us'])}/step for it",
            r, None, (d.get("kernels") or [{}])[0].get("name", "") or (ev.get("by_class") or [{}])[0].get("cls", ""),
            ev.get("loss_us", 0.0), ev,
            f"Rank {r} makes rank(s) {wr or 'the others'} wait at collectives. Compared with rank {ev['base_rank']} "
            f"(the median rank): {what or 'no class or kernel stands out'}. Remove the rank-specific work or balance "
            "it (same batch shapes and sequence lengths on every rank, no logging/eval/checkpointing on one rank "
            "inside the step, check that GPU's clocks and temperature). "
            f"Expected saving: about {_ms(ev.get('loss_per_step_us', 0.0))} per step "
            f"({_ms(ev.get('loss_us', 0.0))} over the analysed steps).{miss}"))
    return out


def abnormal_worker(cross: dict) -> list[dict]:
    """ABNORMAL_WORKER: a rank far above the others in one work metric (stragglers excluded:
    STRAGGLER_RANK already explains them)."""
    from aiprof.analysis import ranks as rk

    strag = {ev["straggler_rank"] for ev in cross.get("stragglers", [])}
    by_rank: dict[int, list[dict]] = {}
    for a in cross.get("abnormal", []):
        if a["rank"] not in strag:
            by_rank.setdefault(a["rank"], []).append(a)
    out = []
    for r, items in sorted(by_rank.items()):
        items.sort(key=lambda a: -a["excess_per_step_us"])
        top = items[0]
        rel = top.get("excess_rel") or 0.0
        host = f" on {top['host']}" if top.get("host") else ""
        impact = sum(a["excess_per_step_us"] * a["steps"] for a in items if a["metric"] != "step time (median)") \
            or top["excess_per_step_us"] * top["steps"]
        out.append(_f(
            "ABNORMAL_WORKER", HIGH if rel >= rk.ABNORMAL_HIGH_REL else MEDIUM,
            f"rank {r}{host}: {top['metric']} {_ms(top['value_us'])}/step, {100 * rel:.0f}% above the other ranks' "
            f"median {_ms(top['median_others_us'])}",
            r, None, top["metric"], impact, {"rank": r, "metrics": items},
            f"Rank {r} differs from the others in " + ", ".join(f"{a['metric']} (+{_ms(a['excess_per_step_us'])}/step, "
                                                              f"z={a['z']:.1f})" for a in items[:3])
            + ". Check that rank's input (shapes, data shard), its GPU (clocks, temperature, ECC/XID errors in "
            "nvidia-smi) and its host (other processes, CPU affinity, NUMA); compare it with `aiprof diff` against "
            f"another rank. Expected saving: up to {_ms(impact)} over the analysed steps."))
    return out


RULES = (step_outlier, data_loading, host_bound, sync_stall, comm_exposed, memcpy_pageable, low_tensor_core,
         kernel_hotspot)


CROSS_RULES = (straggler_rank, abnormal_worker)


def findings(facts: list[RankFacts], cross: dict | None = None) -> list[dict]:
    """All findings of all ranks (and of the cross-rank analysis), most impact first."""
    out: list[dict] = []
    for f in facts:
        for rule in RULES:
            out.extend(rule(f))
    if cross:
        for crule in CROSS_RULES:
            out.extend(crule(cross))
    out.sort(key=lambda d: -d["impact_us"])
    return out
