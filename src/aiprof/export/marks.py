"""Findings as slices on each rank's "findings" track of a timeline export."""
from __future__ import annotations

from aiprof.export.timeline import Mark


def marks_from_report(report: dict) -> list[Mark]:
    """One slice per finding: over its step's window when it names a step, else over the rank's window."""
    out: list[Mark] = []
    ranks = {r["rank"]: r for r in report.get("ranks", [])}
    for f in report.get("findings", []):
        r = ranks.get(f.get("rank"))
        if r is None:
            continue
        label = f"[{f['severity']}] {f['code']}: {f['title']}"
        step = next((s for s in r["steps"] if s["step"] == f.get("step")), None)
        if step is not None:
            start, end = step["start_ns"], step["start_ns"] + int(step["duration_us"] * 1000)
        else:
            start, end = r["window"]["start_ns"], r["window"]["end_ns"]
        out.append(Mark(rank=r["rank"], start=int(start), end=int(end), name=label))
    return out
