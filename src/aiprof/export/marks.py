"""Causes and unexplained symptoms as slices on each rank's "findings" track of a timeline export."""
from __future__ import annotations

from aiprof.export.timeline import Mark


def _window(r: dict, steps: list[int]) -> tuple[int, int]:
    """The rank's window, or the span of the named steps."""
    sel = [s for s in r["steps"] if s["step"] in steps]
    if sel:
        return sel[0]["start_ns"], sel[-1]["start_ns"] + int(sel[-1]["duration_us"] * 1000)
    return r["window"]["start_ns"], r["window"]["end_ns"]


def marks_from_report(report: dict) -> list[Mark]:
    """One slice per cause on its rank (job-wide causes on every rank), over the steps it names
    or the whole window; one per symptom that no cause explains."""
    out: list[Mark] = []
    ranks = {r["rank"]: r for r in report.get("ranks", [])}
    for c in report.get("causes", []):
        targets = list(ranks) if c.get("rank") is None else [c["rank"]]
        saving = c.get("saving", {})
        label = (f"[{c['severity']}] {c['code']}: {c['title']} (saves {saving.get('per_step_us', 0.0) / 1000:.1f} ms/step)")
        for rk in targets:
            r = ranks.get(rk)
            if r is None:
                continue
            start, end = _window(r, (c.get("place") or {}).get("steps") or [])
            out.append(Mark(rank=rk, start=int(start), end=int(end), name=label))
    for s in report.get("symptoms", []):
        r = ranks.get(s.get("rank"))
        if r is None or not s.get("orphan"):
            continue
        step = (s.get("detail") or {}).get("step")
        start, end = _window(r, [step] if step is not None else [])
        out.append(Mark(rank=r["rank"], start=int(start), end=int(end), name=f"{s['code']} (no cause found): {s['title']}"))
    return out
