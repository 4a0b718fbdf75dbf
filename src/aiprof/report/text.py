"""Terminal report: renders a report dict (schema aiprof.report/1) with rich. Computes nothing."""
from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

_MAX_RANK_DETAIL = 8  # beyond this many ranks, steps tables give way to one row per rank


def _ms(us: float) -> str:
    return f"{us / 1000.0:,.2f}"


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _steps_table(rank: dict) -> Table:
    t = Table(title=f"Steps (from {rank['step_source']}), times in ms", title_justify="left", show_edge=False)
    for col in ("step", "duration", "compute", "comm (exposed)", "memory", "idle", "GPU busy", "runtime", "sync", "launches"):
        t.add_column(col, justify="right")
    for s in rank["steps"]:
        t.add_row(str(s["step"]), _ms(s["duration_us"]), _ms(s["compute_us"]), _ms(s["communication_us"]),
                  _ms(s["memory_us"]), _ms(s["idle_us"]), f"{s['gpu_busy_pct']:.1f}%", _ms(s["runtime_us"]),
                  _ms(s["sync_us"]), str(s["kernels_launched"]))
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


def _ranks_table(report: dict) -> Table:
    t = Table(title="Ranks (sums over steps), times in ms", title_justify="left", show_edge=False)
    for col in ("rank", "steps", "median step", "compute", "comm (exposed)", "memory", "idle", "GPU busy"):
        t.add_column(col, justify="right")
    for r in report["ranks"]:
        s = r["summary"]
        if not s:
            continue
        t.add_row(str(r["rank"]), str(s["steps"]), _ms(s["step_median_us"]), _ms(s["compute_us"]),
                  _ms(s["communication_us"]), _ms(s["memory_us"]), _ms(s["idle_us"]), f"{s['gpu_busy_pct']:.1f}%")
    return t


def _findings(console: Console, findings: list[dict]) -> None:
    if not findings:
        console.print(Text("Findings: none", style="green"))
        return
    console.print(Text("Findings (most impact first)", style="bold"))
    for i, f in enumerate(findings, 1):
        sev = {"high": "bold red", "medium": "yellow", "low": "cyan"}.get(f.get("severity", ""), "")
        where = f" · {f['where']}" if f.get("where") else ""
        rank = f" · rank {f['rank']}" if f.get("rank") is not None else ""
        step = f" · step {f['step']}" if f.get("step") is not None else ""
        console.print(Text.assemble((f"{i}. [{f['severity']}] {f['code']}", sev),
                                    f"  {f['title']}{rank}{step}{where}  (≈{_ms(f.get('impact_us', 0))} ms)"))
        if f.get("suggestion"):
            console.print(f"   → {f['suggestion']}")


def render(report: dict, file: IO[str] | None = None, width: int | None = None) -> None:
    """Write the human-readable report to ``file`` (stdout by default)."""
    console = Console(file=file, width=width or 140, highlight=False, soft_wrap=False)
    cap = report["capture"]
    console.print(Text(f"aiprof report · {len(cap['ranks_found'])} rank(s) of world size {cap['world_size']}",
                       style="bold"))
    ranks = report["ranks"]
    if len(ranks) > 1:
        console.print(_ranks_table(report))
        console.print()
    for r in ranks[:_MAX_RANK_DETAIL]:
        dev = r["device"]
        s = r["summary"]
        console.print(Text(f"Rank {r['rank']} · {dev.get('name') or 'unknown device'} · {r['source']}", style="bold cyan"))
        if s:
            console.print(f"window {_ms(r['window']['duration_us'])} ms · {s['steps']} step(s), median "
                          f"{_ms(s['step_median_us'])} ms · GPU busy {s['gpu_busy_pct']:.1f}% · "
                          f"compute {_ms(s['compute_us'])} · exposed comm {_ms(s['communication_us'])} · "
                          f"memory {_ms(s['memory_us'])} · idle {_ms(s['idle_us'])} ms")
        console.print(_steps_table(r))
        if r["top_kernels"]:
            console.print(_kernels_table(r))
        console.print()
    if len(ranks) > _MAX_RANK_DETAIL:
        console.print(f"({len(ranks) - _MAX_RANK_DETAIL} more ranks: see the JSON report)")
    _findings(console, report.get("findings", []))
