"""Terminal rendering of a rank's serving section (analysis/serving.py). Computes nothing."""
from __future__ import annotations

from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table


UNKNOWN = "—"  # report/text.py UNKNOWN: a figure the capture cannot give, with its reason


def _ms(us: float) -> str:
    return f"{us / 1000.0:,.2f}"


def _utc(unix_ns: int) -> str:
    """A wall-clock instant (formatting only)."""
    return datetime.fromtimestamp(unix_ns / 1e9, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def render_serving(console: Console, rank: dict) -> None:
    """Phases, tokens/s, batch sizes and inter-token gaps of an inference trace, if it has them."""
    sv = rank.get("serving")
    s = (sv or {}).get("summary") or {}
    if not s:
        return
    model = f" · model {sv['model']}" if sv.get("model") else ""
    console.print(f"Serving{model} · {s['busy_iterations']} of {s['iterations']} iterations ran the model · "
                  f"{s['tokens_out']} tokens generated, {s['tokens_in']} processed · "
                  f"{s['tokens_per_s']:,.1f} tokens/s over {_ms(s['span_us'])} ms"
                  + ("" if sv.get("shapes") else " (no input shapes recorded: capture with --what shapes for "
                                                 "tokens and phases)"))
    iv = s.get("interval")
    if iv:
        run = iv.get("whole_run_tokens_per_s")
        console.print(f"tokens/s interval: the {iv['covers']}, its first to last model iteration, "
                      f"{_ms(iv['from_capture_start_us'])}–{_ms(iv['to_capture_start_us'])} ms after the capture's "
                      f"first event ({_ms(iv['duration_us'])} of {_ms(iv['capture_duration_us'])} ms)"
                      + (f", {_utc(iv['start_unix_ns'])} to {_utc(iv['end_unix_ns'])} UTC" if iv.get("start_unix_ns") else "")
                      + (f" · whole run: {run:,.1f} tokens/s" if run is not None else
                         f" · whole run: {UNKNOWN} ({iv['whole_run_reason']})"))
    b, itl = s["batch"], s["inter_token_us"]
    extra = []
    if s.get("gpu_busy_pct") is not None:
        extra.append(f"GPU busy {s['gpu_busy_pct']:.1f}% of the model's iterations")
    if s.get("host_overhead_pct") is not None:
        extra.append(f"host outside the forward {s['host_overhead_pct']:.1f}%")
    console.print(f"batch (sequences sampled per iteration): median {b['median']:.0f}, max {b['max']} · inter-token gap "
                  f"p50 {_ms(itl['p50'])} ms, p90 {_ms(itl['p90'])} ms, max {_ms(itl['max'])} ms"
                  + ("".join(f" · {e}" for e in extra)))
    t = Table(title="Serving iterations by phase, times in ms", title_justify="left", show_edge=False)
    for col in ("phase", "iterations", "time", "share", "median", "p90", "tokens in", "tokens out"):
        t.add_column(col, justify="right" if col != "phase" else "left")
    for p, v in s["by_phase"].items():
        t.add_row(p, str(v["iterations"]), _ms(v["time_us"]), f"{100 * v['share']:.1f}%", _ms(v["median_us"]),
                  _ms(v["p90_us"]), str(v["tokens_in"]), str(v["tokens_out"]))
    console.print(t)
