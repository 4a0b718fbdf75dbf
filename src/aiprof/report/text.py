"""Terminal report: renders a report dict (schema aiprof.report/2) with rich. Computes nothing."""
from __future__ import annotations

import os
import shutil
import sys
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from aiprof.report.serving_text import render_serving
from aiprof.termtext import safe

_MAX_RANK_DETAIL = 8  # beyond this many ranks, steps tables give way to one row per rank
_PATH_ROWS = 8  # leaves of the critical-path table (the JSON keeps diagnosis.critical_path.TOP_LEAVES)
# A pipe or a file has no width: wide enough that the widest table (counters, 12 columns) keeps
# its rows on one line, and the same on every machine so saved reports diff cleanly.
PIPED_WIDTH = 140
DIFF_PIPED_WIDTH = 160  # the diff's table carries a host-stack column on top
MIN_WIDTH = 40  # narrower than this, rich squeezes every cell to a letter: wrap instead
# A cause's stand-alone saving is shown beside its marginal one when they differ by this share of
# the step (the report's floor, 1 %: a smaller difference changes no decision).
ALONE_SHOWN_SHARE = 0.01
# A minor cause (it adds < 1 % once the causes above are fixed) that would save at least this
# share of the step alone is named under the causes: an alternative remedy for the same time
# (decode CUDA graphs where batching is not possible), worth a change by itself (MEDIUM_SHARE).
ALTERNATIVE_MIN_SHARE = 0.03
_MAX_ALTERNATIVES = 3


def output_width(file: IO[str] | None = None, piped: int = PIPED_WIDTH) -> int:
    """Columns to render for: on stdout, $COLUMNS if set, else the terminal's width, else ``piped``;
    an explicit ``file`` (report.txt) gets ``piped`` unless it is itself a terminal."""
    out = sys.stdout if file is None else file
    if file is None:
        try:
            cols = int(os.environ.get("COLUMNS", ""))
            if cols > 0:
                return max(cols, MIN_WIDTH)
        except ValueError:
            pass
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):  # StringIO without isatty, a closed stream
        tty = False
    if not tty:
        return piped
    return max(shutil.get_terminal_size((piped, 24)).columns, MIN_WIDTH)


def _console(file: IO[str] | None, width: int) -> Console:
    # markup off: every string printed here holds names from the trace ("gemm[/bold]" would raise,
    # "[link=…]" would make a link); styles come from Text objects only. Emoji codes (":fire:") off
    # for the same reason.
    return Console(file=file, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False)


def _ms(us: float) -> str:
    return f"{us / 1000.0:,.2f}"


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


#: Narrowest a kernel-family column may get in a wide table: "vectorized_elementwise_kernel" (29)
#: and "unrolled_elementwise_kernel" must stay apart.
FAMILY_MIN_WIDTH = 30


def _family_label(family: str) -> str:
    """A kernel family as shown: PyTorch's own namespace left out (every ATen kernel has it)."""
    return family.removeprefix("at::native::")


def _has_gpu(rank: dict) -> bool:
    """False for a CPU-only capture: its GPU breakdown (all idle, all zero) means nothing."""
    if "hotspots" not in rank:  # a brief section (many ranks): no hotspots table, the device says
        return rank["device"].get("kind") == "gpu"
    return bool((rank.get("hotspots") or {}).get("has_gpu", True))


def _steps_table(rank: dict) -> Table:
    within = f" within {rank['step_within']}" if rank.get("step_within") else ""
    title = f"Steps (from {rank['step_source']}{within}), times in ms"
    t = Table(title=title, title_justify="left", show_edge=False, min_width=len(title))
    if not _has_gpu(rank):
        for col in ("step", "duration", "data loading"):
            t.add_column(col, justify="right")
        for s in rank["steps"]:
            t.add_row(str(s["step"]), _ms(s["duration_us"]), _ms(s["dataloader_us"]))
        return t
    for col in ("step", "duration", "compute", "comm (exposed)", "memory", "idle", "GPU busy", "runtime", "sync",
                "data loading", "launches"):
        t.add_column(col, justify="right")
    for s in rank["steps"]:
        t.add_row(str(s["step"]), _ms(s["duration_us"]), _ms(s["compute_us"]), _ms(s["communication_us"]),
                  _ms(s["memory_us"]), _ms(s["idle_us"]), f"{s['gpu_busy_pct']:.1f}%", _ms(s["runtime_us"]),
                  _ms(s["sync_us"]), _ms(s["dataloader_us"]), str(s["kernels_launched"]))
    return t


def _kernels_table(rank: dict) -> Table:
    t = Table(title="Top GPU kernels by time", title_justify="left", show_edge=False)
    for col, j in (("kernel", "left"), ("class", "left"), ("calls", "right"), ("total ms", "right"),
                   ("mean µs", "right"), ("share", "right")):
        t.add_column(col, justify=j)
    for k in rank["top_kernels"]:
        t.add_row(_short(k["name"]), k["cls"], str(k["calls"]), _ms(k["total_us"]), f"{k['mean_us']:.1f}",
                  f"{k['share_pct']:.1f}%")
    return t


def _pm(m: dict, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    v = m.get(key)
    return "" if v is None else fmt.format(v * scale)


def _counters_table(rank: dict) -> Table | None:
    """Kernel families with the GPU's PM counters during them (analysis.counters)."""
    c = rank.get("counters")
    if not c or not c.get("families"):
        return None
    iv, al = c.get("interval_us") or {}, c.get("alignment") or {}
    lag = (f"residual lag {al['lag_us']:+.0f} µs (r={al['correlation']:.2f}, {al.get('signal', '')})"
           + (" removed" if al.get("applied_shift_us") else " kept") if al.get("lag_us") is not None
           else f"alignment not checked: {al.get('why') or 'no SM-active or tensor-pipe counter'}")
    t = Table(title=(f"Kernel families · GPU counters ({c['samples']} PM samples every {iv.get('median', 0):.0f} µs, "
                     f"p99 gap {iv.get('p99', 0):.0f} µs; {lag})"), title_justify="left", show_edge=False)
    for col in ("family", "kernels", "sampled ms", "cover", "SM act %", "issue %", "tensor %", "DRAM rd GB/s",
                "DRAM wr GB/s", "DRAM % peak", "L2 GB/s", "bound"):
        # the family names the row: never squeezed to "at::native…", which names several
        t.add_column(col, justify="left" if col in ("family", "bound") else "right",
                     **({"min_width": FAMILY_MIN_WIDTH, "overflow": "fold"} if col == "family" else {}))
    for f in c["families"][:15]:
        m = f["counters"]
        d = f.get("dram_pct_of_peak")
        t.add_row(_short(_family_label(f["family"]), 48), str(f["kernels"]), _ms(f["sampled_us"]), f"{f['coverage_pct']:.0f}%",
                  _pm(m, "pm_sm_active_pct"), _pm(m, "pm_sm_issue_pct"), _pm(m, "pm_tensor_active_pct"),
                  _pm(m, "pm_dram_read_Bps", 1e-9), _pm(m, "pm_dram_write_Bps", 1e-9),
                  "" if d is None else f"{d:.0f}", _pm(m, "pm_l2_Bps", 1e-9), f["bound"])
    return t


def _collective_counters_table(rank: dict) -> Table | None:
    """Communication kernels with the NVLink traffic the PM counters saw during them."""
    c = rank.get("counters")
    rows = [x for x in (c or {}).get("collectives") or [] if x.get("nvlink_tx_gbps") is not None
            or x.get("nvlink_rx_gbps") is not None]
    if not rows:
        return None
    peak = c.get("nvlink_peak_gbps")
    t = Table(title=("Collectives · NVLink during them (PM counters; GB/s per direction"
                     + (f", peak {peak:.0f})" if peak else ")")), title_justify="left", show_edge=False)
    for col in ("kernel", "calls", "sampled ms", "NVLink tx GB/s", "NVLink rx GB/s", "% of peak"):
        t.add_column(col, justify="left" if col == "kernel" else "right")
    for x in rows[:8]:
        pct = x.get("nvlink_pct_of_peak")
        t.add_row(_short(x["name"], 48), str(x["calls"]), _ms(x["sampled_us"]),
                  "" if x.get("nvlink_tx_gbps") is None else f"{x['nvlink_tx_gbps']:.1f}",
                  "" if x.get("nvlink_rx_gbps") is None else f"{x['nvlink_rx_gbps']:.1f}",
                  "" if pct is None else f"{pct:.0f}%")
    return t


def _roofline_table(rank: dict) -> Table | None:
    """Kernel families on the roofline (analysis.roofline): work from the ops' shapes vs time."""
    r = rank.get("roofline")
    if not r or not r.get("families"):
        return None
    t = Table(title=(f"Roofline by kernel family (work from the ops' input shapes; {r['covered_pct']:.0f}% of compute "
                     f"time covered; HBM {r['dram_gbps']:.0f} GB/s; docs/metrics.md)"),
              title_justify="left", show_edge=False)
    for col in ("family", "ops", "calls", "ms", "FLOP/B", "TFLOP/s", "GB/s", "roof", "% of roof", "bound"):
        t.add_column(col, justify="left" if col in ("family", "ops", "roof", "bound") else "right")
    for f in r["families"][:12]:
        roof = "HBM" if f["side"] == "memory" else f["compute_peak"].replace("tensor cores", "TC").replace(" CUDA cores", "")
        t.add_row(_short(f["family"].removeprefix("at::native::"), 40),
                  _short(", ".join(o.removeprefix("aten::") for o in f["ops"][:2]), 28), str(f["calls"]), _ms(f["gpu_us"]),
                  f"{f['intensity']:.2f}" if f["intensity"] < 10 else f"{f['intensity']:.0f}", f"{f['tflops_per_s']:.1f}",
                  f"{f['gbps']:.0f}", roof, f"{f['roof_pct']:.0f}%", f["bound"])
    return t


def _ranks_table(report: dict) -> Table:
    t = Table(title="Ranks (sums over steps), times in ms", title_justify="left", show_edge=False)
    gpu = any(_has_gpu(r) for r in report["ranks"])
    for col in ("rank", "steps", "median step") + (("compute", "comm (exposed)", "memory", "idle", "GPU busy") if gpu else ()):
        t.add_column(col, justify="right")
    for r in report["ranks"]:
        s = r["summary"]
        if not s:
            continue
        if not gpu:
            t.add_row(str(r["rank"]), str(s["steps"]), _ms(s["step_median_us"]))
            continue
        t.add_row(str(r["rank"]), str(s["steps"]), _ms(s["step_median_us"]), _ms(s["compute_us"]),
                  _ms(s["communication_us"]), _ms(s["memory_us"]), _ms(s["idle_us"]), f"{s['gpu_busy_pct']:.1f}%")
    return t


def _causes(console: Console, report: dict) -> None:
    """Causes first (ranked by saving), the symptoms each explains under it, then the symptoms
    no cause explains. Everything here is computed by aiprof.diagnosis."""
    causes = report.get("causes", [])
    verdict = report.get("verdict") or {}
    if verdict.get("healthy") or not causes:
        # a healthy job: one line (its small causes are in the JSON, docs/report.md "verdict")
        console.print(Text(verdict.get("line") or "Causes: none found (no fix would save 1% of a step)", style="green"))
        causes = []
    else:
        console.print(Text("Causes, by what fixing them saves (docs/findings.md)", style="bold"))
    for i, c in enumerate(causes, 1):
        sev = {"high": "bold red", "medium": "yellow", "low": "cyan"}.get(c.get("severity", ""), "")
        sv = c.get("saving", {})
        who = "job" if c.get("rank") is None else f"rank {c['rank']}"
        step = sv.get("baseline_step_us") or 0.0
        one_off = (c.get("evidence") or {}).get("step")
        in_step = (sv.get("by_step_us") or {}).get(str(one_off), (sv.get("by_step_us") or {}).get(one_off))
        if one_off is not None and in_step is not None:
            # a one-off (HOST_STALL): its loss is that step's; the share is of the averaged step
            console.print(Text.assemble((f"{i}. [{c['severity']}] {c['code']}", sev), f" · {who} · saves ",
                                        (f"{_ms(in_step)} ms in step {one_off}", "bold"),
                                        f" ({_ms(sv.get('per_step_us', 0.0))} ms per step over the analysed steps, "
                                        f"{100 * sv.get('share', 0.0):.1f}% of a {_ms(step)} ms step)"))
        else:
            console.print(Text.assemble((f"{i}. [{c['severity']}] {c['code']}", sev), f" · {who} · saves ",
                                        (f"{_ms(sv.get('per_step_us', 0.0))} ms per step", "bold"),
                                        f" ({100 * sv.get('share', 0.0):.1f}% of a {_ms(step)} ms step{_marginal(sv)})"))
        console.print(f"   {c['title']}")
        place = c.get("place") or {}
        where = place.get("site") or place.get("name") or ""
        if where:
            console.print(f"   where: {where}" + (f" (steps {', '.join(map(str, place['steps']))})" if place.get("steps") else ""))
        console.print(f"   why:   {c['mechanism']}")
        console.print(f"   fix:   {c['remedy']}")
        for sym in c.get("symptoms", [])[:4]:
            console.print(f"   explains: {sym['title']} — {_ms(sym['explained_us'] / max(_steps_of(report, sym), 1))} ms per step of it")
    minor = report.get("minor") or []
    if minor:
        console.print(Text(f"({len(minor)} minor cause(s) below 1% of a step each: in the JSON report under \"minor\")",
                           style="dim"))
        if causes:
            # an alternative remedy for time a cause above already wins: worth knowing on its own
            alternatives = [c for c in minor if c["saving"].get("alone_share", 0.0) >= ALTERNATIVE_MIN_SHARE
                            and c["saving"].get("marginal_to")]
            for c in alternatives[:_MAX_ALTERNATIVES]:
                sv, before = c["saving"], list(dict.fromkeys(c["saving"].get("marginal_to") or []))
                console.print(Text(f"   {c['code']} · {'job' if c.get('rank') is None else 'rank ' + str(c['rank'])} would "
                                   f"save {_ms(sv['alone_us'])} ms per step alone ({100 * sv['alone_share']:.1f}%), "
                                   f"{_ms(sv.get('per_step_us', 0.0))} ms once {', '.join(before)} "
                                   f"{'is' if len(before) == 1 else 'are'} fixed: {c['title']}", style="dim"))
    orphans = [s for s in report.get("symptoms", []) if s.get("orphan")]
    if orphans:
        console.print(Text("Symptoms no cause explains", style="bold"))
        for s in orphans:
            rank = "job" if s.get("rank") is None else f"rank {s['rank']}"
            console.print(f"   - {rank}: {s['title']} — {_ms(s['unexplained_us'] / max(_steps_of(report, s), 1))} ms per "
                          "step unexplained; no detected mechanism accounts for it (see the hotspots and the step diff)")
    path = _critical_path_table(report)
    if path is not None:
        console.print(path)
    line = baseline_line(report.get("baseline", []))
    if line:
        console.print(Text(line, style="dim"))


def rank_list(ranks: list[int]) -> str:
    """Ranks as the report names them: runs of three or more consecutive ranks as ranges
    ("0–3, 6, 8, 9")."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if j == i else f"{rs[i]}–{rs[j]}" if j > i + 1 else f"{rs[i]}, {rs[j]}")
        i = j + 1
    return ", ".join(out)


def _span(values: list[float]) -> str:
    """One value in ms, or the range of several."""
    lo, hi = min(values), max(values)
    return f"{_ms(lo)} ms" if _ms(lo) == _ms(hi) else f"{_ms(lo)}–{_ms(hi)} ms"


def baseline_line(rows: list[dict]) -> str:
    """The report's footer: the step the savings are shares of, and on which ranks the agent
    measured the unprofiled step the replay is fitted to (the others: fitted together with
    them when the job's ranks are coupled, else priced from the recording)."""
    if not rows:
        return ""
    shares = _span([b.get("baseline_step_us", b["replayed_step_us"]) for b in rows])
    longer = any(b.get("baseline_step_us", b["replayed_step_us"]) < b["replayed_step_us"] for b in rows)
    tail = (f"; savings are shares of the {shares} unprofiled step (the replay of the recording, "
            f"{_span([b['replayed_step_us'] for b in rows])}, could not be fitted down to it)" if longer else
            f"; savings are shares of the replayed {shares} step")
    recorded = f"recorded {_span([b['recorded_step_us'] for b in rows])} under the profiler"
    if len(rows) == 1:
        b, un = rows[0], rows[0].get("unprofiled_step_us")
        return (f"rank {b['rank']}: recorded step {_ms(b['recorded_step_us'])} ms under the profiler; "
                + (f"unprofiled {_ms(un)} ms (measured by the agent before the capture)" if un else
                   "unprofiled step not recorded (estimated by removing the profiler's cost)") + tail)
    have = [b for b in rows if b.get("unprofiled_step_us")]
    if not have:
        return (f"unprofiled step recorded on no rank (ranks {rank_list([b['rank'] for b in rows])}): priced from the "
                f"recording, the profiler's cost removed by estimate; {recorded}" + tail)
    head = (f"unprofiled step measured by the agent on {_ranks([b['rank'] for b in have])} "
            f"({_span([b['unprofiled_step_us'] for b in have])}; {recorded})")
    fitted = [b["rank"] for b in rows if not b.get("unprofiled_step_us") and b.get("priced_from") == "job unprofiled"]
    alone = [b["rank"] for b in rows if not b.get("unprofiled_step_us") and b.get("priced_from") != "job unprofiled"]
    if fitted:
        head += f"; {_ranks(fitted)} had none: replayed with the others, fitted to theirs"
    if alone:
        head += f"; {_ranks(alone)} priced from the recording (the profiler's cost removed by estimate)"
    return head + tail


def _ranks(ranks: list[int]) -> str:
    """"rank 3" or "ranks 0, 2"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def _critical_path_table(report: dict) -> Table | None:
    """Where the replayed step of one rank goes, leaf by leaf (the first cause's rank, else the
    first rank): the diagnosis's critical-path rows, as computed."""
    base = report.get("baseline") or []
    causes = report.get("causes") or []
    want = causes[0].get("rank") if causes and causes[0].get("rank") is not None else None
    b = next((x for x in base if x.get("rank") == want), base[0] if base else None)
    cp = (b or {}).get("critical_path")
    if not cp or not cp.get("leaves"):
        return None
    waits = f"; the GPU waits for the host in {100 * cp['loss_share']:.0f}% of it" if cp.get("gpu") else ""
    t = Table(title=f"Where rank {b['rank']}'s replayed {_ms(cp['per_step_us'])} ms step goes (critical path, by leaf"
                    f"{waits})",
              title_justify="left", show_edge=False)
    for col, j in (("ms/step", "right"), ("share", "right"), ("kind", "left"), ("leaf", "left"),
                   ("called from", "left"), ("claimed by", "left")):
        t.add_column(col, justify=j, overflow="fold")
    for lf in cp["leaves"][:_PATH_ROWS]:
        where = " in ".join(x for x in (lf.get("entry_label", ""), lf.get("site", "")) if x)
        t.add_row(_ms(lf["per_step_us"]), f"{100 * lf['share']:.1f}%", lf["kind"] + (" (GPU idle)" if lf["loss"] else ""),
                  lf.get("label") or lf["name"], where, ", ".join(lf["claimed_by"]) or ("no cause" if lf["loss"] else "—"))
    rest = cp.get("other_per_step_us", 0.0) + sum(lf["per_step_us"] for lf in cp["leaves"][_PATH_ROWS:])
    if rest > 0:
        t.add_row(_ms(rest), f"{100 * rest / max(cp['per_step_us'], 1e-9):.1f}%", "",
                  f"{cp.get('other_leaves', 0) + max(len(cp['leaves']) - _PATH_ROWS, 0)} other leaves", "", "")
    return t


def _marginal(sv: dict) -> str:
    """The fixes a cause's saving is marginal to, and what it saves by itself, where the two
    differ by at least ALONE_SHOWN_SHARE of the step (the savings shown add up; docs/findings.md)."""
    alone, step, before = sv.get("alone_us"), sv.get("baseline_step_us") or 0.0, sv.get("marginal_to") or []
    if alone is None or not before or step <= 0 or abs(alone - sv.get("per_step_us", 0.0)) < ALONE_SHOWN_SHARE * step:
        return ""
    names = list(dict.fromkeys(before))
    return f" once {', '.join(names)} {'is' if len(names) == 1 else 'are'} fixed; {_ms(alone)} ms alone"


def _steps_of(report: dict, item: dict) -> int:
    """Steps the rank (or, for job-wide items, the first rank) analysed."""
    for r in report.get("ranks", []):
        if item.get("rank") in (None, r["rank"]):
            return max(len(r["steps"]), 1)
    return 1


def render(report: dict, file: IO[str] | None = None, width: int | None = None) -> None:
    """Write the human-readable report to ``file`` (stdout by default)."""
    report = safe(report)  # names from the trace: control characters shown as escapes
    console = _console(file, width or output_width(file))
    cap = report["capture"]
    console.print(Text(f"aiprof report · {len(cap['ranks_found'])} rank(s) of world size {cap['world_size']}",
                       style="bold"))
    ranks = report["ranks"]
    if len(ranks) > 1:
        console.print(_ranks_table(report))
        _cross_rank(console, report.get("cross_rank"))
        console.print()
    detail = cap.get("detail_ranks")  # a report of many ranks: the ones whose tables it kept, most telling first
    shown = [r for k in detail for r in ranks if r["rank"] == k] if detail is not None else ranks
    for r in shown[:_MAX_RANK_DETAIL]:
        dev = r["device"]
        s = r["summary"]
        console.print(Text(f"Rank {r['rank']} · {device_label(dev)} · {r['source']}", style="bold cyan"))
        if s and not _has_gpu(r):
            console.print(f"window {_ms(r['window']['duration_us'])} ms · {s['steps']} step(s), median "
                          f"{_ms(s['step_median_us'])} ms · no GPU activity in this capture (CPU only): no GPU breakdown")
        elif s:
            console.print(f"window {_ms(r['window']['duration_us'])} ms · {s['steps']} step(s), median "
                          f"{_ms(s['step_median_us'])} ms · GPU busy {s['gpu_busy_pct']:.1f}% · "
                          f"compute {_ms(s['compute_us'])} · exposed comm {_ms(s['communication_us'])} · "
                          f"memory {_ms(s['memory_us'])} · idle {_ms(s['idle_us'])} ms")
        console.print(_steps_table(r))
        render_serving(console, r)
        if r["top_kernels"]:
            console.print(_kernels_table(r))
        for table in (_roofline_table(r), _counters_table(r), _collective_counters_table(r)):
            if table is not None:
                console.print(table)
        render_diagnosis(console, r)
        _native(console, r)
        console.print()
    more = len(ranks) - min(len(shown), _MAX_RANK_DETAIL)
    if detail is not None:
        console.print(f"({more} more ranks: the JSON report has every rank's steps and the tables of "
                      f"the {len(detail)} it names; `aiprof ui` shows any rank's tables)")
    elif more > 0:
        console.print(f"({more} more ranks: see the JSON report)")
    _causes(console, report)


def _cross_rank(console: Console, cr: dict | None) -> None:
    """Cross-rank section: clock alignment, arrivals at collectives, flags (analysis.ranks)."""
    if not cr:
        return
    al, arr, flags = cr["alignment"], cr["arrivals"], cr.get("flags", {})
    if cr.get("missing_ranks"):
        m = cr["missing_ranks"]
        console.print(Text(f"Ranks missing from the capture: {', '.join(map(str, m[:20]))}"
                           + (f" … ({len(m)})" if len(m) > 20 else ""), style="yellow"))
    console.print(f"Clocks aligned to rank {al['reference_rank']}: {al['method']}; "
                  f"{arr['collectives']} collectives matched across ranks")
    t = Table(title="Cross-rank (per step: wait caused as last arrival, wait at collectives)", title_justify="left",
              show_edge=False)
    for col in ("rank", "host", "flags", "clock offset µs", "last at", "caused ms/step", "waited ms/step"):
        t.add_column(col, justify="left" if col in ("host", "flags") else "right")
    for i, r in enumerate(cr["ranks"]):
        k = str(r)
        n = max(sum(v is not None for v in cr["matrix"]["step_us"][i]), 1)  # the rank's steps
        if len(cr["ranks"]) > _MAX_RANK_DETAIL and not flags.get(k):
            continue  # many ranks: only the flagged ones
        t.add_row(k, cr["hosts"].get(k, "") or "-", ",".join(flags.get(k, [])) or "-",
                  f"{al['offset_us'].get(k, 0.0):+.1f}", f"{arr['last_count'].get(k, 0)}/{arr['present'].get(k, 0)}",
                  _ms(arr["caused_wait_us"].get(k, 0.0) / n), _ms(arr["waited_us"].get(k, 0.0) / n))
    console.print(t)


# ---------------------------------------------------------------- diagnosis sections
def _bottleneck_table(rank: dict) -> Table | None:
    hs = rank.get("hotspots") or {}
    classes = hs.get("classes") or []
    if not classes:
        return None
    t = Table(title="Bottleneck ratio by class (docs/metrics.md)",
              title_justify="left", show_edge=False)
    for col, j in (("class", "left"), ("time ms", "right"), ("ratio", "right")):
        t.add_column(col, justify=j)
    for c in sorted(classes, key=lambda c: -c["ratio"]):
        if c["time_us"] > 0:
            t.add_row(c["cls"], _ms(c["time_us"]), f"{100 * c['ratio']:.1f}%")
    return t


def _hotspots_table(rank: dict, n: int = 12) -> Table | None:
    items = (rank.get("hotspots") or {}).get("items") or []
    if not items:
        return None
    if not _has_gpu(rank):  # no GPU: ranked by host time (the GPU-idle key is 0 everywhere)
        t = Table(title="Host hotspots (Python functions, ops), by inclusive time", title_justify="left", show_edge=False)
        for col, j in (("item", "left"), ("kind", "left"), ("calls", "right"), ("incl ms", "right"), ("excl ms", "right")):
            t.add_column(col, justify=j)
        for h in items[:n]:
            t.add_row(_short(h["name"], 60), h["kind"], str(h["calls"]), _ms(h["inclusive_us"]), _ms(h["exclusive_us"]))
        return t
    t = Table(title="Host hotspots (Python functions, ops), by GPU-idle time inside them", title_justify="left",
              show_edge=False)
    for col, j in (("item", "left"), ("kind", "left"), ("calls", "right"), ("incl ms", "right"), ("excl ms", "right"),
                   ("GPU launched ms", "right"), ("GPU idle ms", "right"), ("bottleneck", "right")):
        t.add_column(col, justify=j)
    for h in items[:n]:
        t.add_row(_short(h["name"], 60), h["kind"], str(h["calls"]), _ms(h["inclusive_us"]), _ms(h["exclusive_us"]),
                  _ms(h["gpu_us"]), _ms(h["idle_us"]), f"{100 * h['bottleneck_ratio']:.1f}%")
    return t


def _syncs_table(rank: dict) -> Table | None:
    rt = rank.get("runtime") or {}
    syncs = rt.get("syncs") or []
    if not syncs:
        return None
    t = Table(title="Blocking synchronisations", title_justify="left", show_edge=False)
    for col, j in (("call", "left"), ("op", "left"), ("site", "left"), ("calls", "right"), ("host wait ms", "right"),
                   ("GPU idle after ms", "right"), ("stall ms", "right")):
        t.add_column(col, justify=j)
    for s in syncs[:8]:
        t.add_row(s["call"], s["op"], _short(s["site"], 40), str(s["calls"]), _ms(s["host_wait_us"]),
                  _ms(s["gpu_idle_after_us"]), _ms(s["stall_us"]))
    return t


def _native(console: Console, rank: dict) -> None:
    """Library calls (probe file), NCCL calls joined to their issuers, blocked system calls."""
    n = rank.get("native")
    if not n:
        return
    if n.get("symbols"):
        t = Table(title="Library calls (probe file; docs/capture.md)", title_justify="left", show_edge=False)
        for col, j in (("library", "left"), ("symbol", "left"), ("calls", "right"), ("total ms", "right"),
                       ("mean µs", "right"), ("max µs", "right"), ("bytes", "right")):
            t.add_column(col, justify=j)
        for x in n["symbols"][:12]:
            t.add_row(x["lib"], x["name"], str(x["calls"]), _ms(x["total_us"]), f"{x['mean_us']:.1f}",
                      f"{x['max_us']:.1f}", f"{x['bytes']:,}" if x["bytes"] else "")
        console.print(t)
    for c in n.get("collectives_by_comm") or []:
        sm = n.get("sizes_match") or {}
        console.print(f"NCCL {c['coll']} on comm {c['comm']}: {c['calls']} calls, {c['bytes'] / 1e6:,.1f} MB, host enqueue "
                      f"{_ms(c['host_us'])} ms, GPU {_ms(c['gpu_us'])} ms · sizes equal to torch's record "
                      f"{sm.get('op_equal', 0)}/{sm.get('op_compared', 0)}, to the kernel's {sm.get('equal', 0)}/"
                      f"{sm.get('compared', 0)}")
    if n.get("syscalls"):
        t = Table(title="Blocked in system calls (sampled; docs/capture.md)", title_justify="left", show_edge=False)
        for col, j in (("syscall", "left"), ("class", "left"), ("episodes", "right"), ("blocked ms", "right"),
                       ("GPU idle ms", "right"), ("threads", "right"), ("top file", "left")):
            t.add_column(col, justify=j)
        for x in n["syscalls"][:10]:
            t.add_row(x["name"], x["cls"], str(x["episodes"]), _ms(x["blocked_us"]), _ms(x["while_gpu_idle_us"]),
                      str(x["threads"]), _short(x["top_path"], 40))
        console.print(t)
    for note in n.get("notes") or []:
        console.print(f"native: {note}")


def _comm_table(rank: dict) -> Table | None:
    c = rank.get("communication") or {}
    groups = c.get("groups") or []
    if not groups:
        return None
    t = Table(title=f"Collectives (link: {c.get('link')}; {c.get('link_reason')})", title_justify="left", show_edge=False)
    for col, j in (("collective", "left"), ("pg", "left"), ("size", "left"), ("calls", "right"), ("total ms", "right"),
                   ("mean µs", "right"), ("algbw GB/s", "right"), ("busbw GB/s", "right")):
        t.add_column(col, justify=j)
    for g in groups[:8]:
        t.add_row(g["coll"], g["pg"], g["size_bucket"], str(g["calls"]), _ms(g["total_us"]), f"{g['mean_us']:.1f}",
                  f"{g['algbw_gbps']:.1f}", f"{g['busbw_gbps']:.1f}")
    return t


def _facts_lines(console: Console, rank: dict) -> None:
    k = rank.get("kernels") or {}
    if k.get("compute_us"):
        prec = ", ".join(f"{p} {_ms(v)}" for p, v in (k.get("precision_us") or {}).items())
        console.print(f"tensor cores: {k['tensor_core_pct_of_compute']:.1f}% of compute time · matmul {_ms(k['matmul_us'])} ms"
                      f" (by kernel precision: {prec or 'n/a'}) · {k['launches_per_step']:.0f} launches/step, "
                      f"median kernel {k['median_kernel_us']:.1f} µs")
    ld = (rank.get("runtime") or {}).get("launch_delay_us") or {}
    if ld.get("count"):
        console.print(f"launch → GPU start: p50 {ld['p50']:.1f} µs · p90 {ld['p90']:.1f} µs · max {ld['max']:.1f} µs")
    f = rank.get("flops") or {}
    if f.get("per_step") or f.get("flops_reason"):
        console.print(flops_line(f))
    m = rank.get("memory") or {}
    if m.get("peak_allocated_bytes"):
        tops = ", ".join(f"{a['where']} {a['bytes'] / 2**30:.1f} GiB" for a in (m.get("top_allocators") or [])[:3])
        console.print(f"memory: peak allocated {m['peak_allocated_bytes'] / 2**30:.2f} GiB"
                      + (f" (step {m['peak_step']})" if m.get("peak_step") is not None else "")
                      + f" · peak reserved {m['peak_reserved_bytes'] / 2**30:.2f} GiB · most allocated by {tops}")


UNKNOWN = "—"  # a figure the capture cannot give: shown with its reason, never as 0


def flops_line(f: dict) -> str:
    """FLOPs and MFU (analysis.flops: medians over the steps with FLOPs); unknown as "—" with why."""
    if f.get("total_flops") is None:
        out = f"FLOPs {UNKNOWN} ({f.get('flops_reason') or 'unknown'})"
    else:
        tf = f.get("tflops_per_s")
        out = (f"FLOPs ({f['source']}): {f['total_flops'] / 1e12:.2f} TFLOP over the steps · median step "
               + (f"{tf:.1f} TFLOP/s" if tf is not None else UNKNOWN))
    if f.get("mfu_pct") is not None:
        return out + f" · MFU {f['mfu_pct']:.1f}% of {f['peak_tflops']:.0f} TFLOP/s {f['precision']}"
    why = f.get("mfu_reason")
    return out + f" · MFU {UNKNOWN}" + (f" ({why})" if why and why != f.get("flops_reason") else "")


def device_label(dev: dict) -> str:
    """The device line's name: the GPU's model, "CPU only" for a capture with no GPU."""
    if dev.get("kind") == "cpu":
        return "CPU only"
    return dev.get("name") or "GPU (model not recorded)"


def render_diagnosis(console: Console, rank: dict) -> None:
    """The per-rank diagnosis sections (hotspots, bottlenecks, syncs, comm, facts)."""
    _facts_lines(console, rank)
    for t in (_bottleneck_table(rank), _hotspots_table(rank), _syncs_table(rank), _comm_table(rank)):
        if t is not None:
            console.print(t)


def render_diff(diff: dict, file: IO[str] | None = None, width: int | None = None) -> None:
    """Render a step diff (schema aiprof.diff/1)."""
    diff = safe(diff)
    console = _console(file, width or output_width(file, DIFF_PIPED_WIDTH))
    b, c = diff["base"], diff["compare"]
    same = b["source"] == c["source"]
    lab = (lambda d: f"step {d['step']}") if same else (lambda d: f"{d['source']} step {d['step']}")
    console.print(Text(f"aiprof diff · {lab(c)} ({_ms(c['duration_us'])} ms) vs {lab(b)} ({_ms(b['duration_us'])} ms):"
                       f" Δ {diff['delta_us'] / 1000.0:+,.2f} ms", style="bold"))
    t = Table(title="Root items by contribution to Δtime (gaps = GPU idle, attributed to the host's innermost event)",
              title_justify="left", show_edge=False)
    for col, j in (("kind", "left"), ("item", "left"), ("Δ ms", "right"), ("base ms", "right"), ("compare ms", "right"),
                   ("Δcalls", "right"), ("Δshare", "right"), ("host stack / site", "left")):
        t.add_column(col, justify=j)
    for i in diff["items"]:
        where = " > ".join(s.split(": ")[-1] for s in i["stack"][-3:]) if i["stack"] else ""
        t.add_row(i["kind"] + (f"·{i['host_kind']}" if i["host_kind"] else ""), _short(i["name"], 60),
                  f"{i['delta_us'] / 1000.0:+,.2f}", _ms(i["base_us"]), _ms(i["compare_us"]), f"{i['delta_calls']:+d}",
                  f"{i['delta_share_pp']:+.1f}pp", _short(where, 50))
    console.print(t)
    console.print(f"unexplained (overlapping GPU work): {diff['residual_us'] / 1000.0:+,.2f} ms")
    h = Table(title="Host items (Python functions, ops): inclusive time", title_justify="left", show_edge=False)
    for col, j in (("kind", "left"), ("item", "left"), ("Δ ms", "right"), ("base ms", "right"), ("compare ms", "right"),
                   ("Δcalls", "right")):
        h.add_column(col, justify=j)
    for i in diff["host_items"][:10]:
        h.add_row(i["kind"], _short(i["name"], 70), f"{i['delta_us'] / 1000.0:+,.2f}", _ms(i["base_us"]),
                  _ms(i["compare_us"]), f"{i['delta_calls']:+d}")
    console.print(h)
