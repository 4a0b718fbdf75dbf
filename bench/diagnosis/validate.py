"""Predicted vs measured savings on the diagnosis validation set.

    python bench/diagnosis/validate.py [DIR]     # DIR: gpu_pairs.py's output (default tests/data/diagnosis)

Without DIR it goes on with the v3 and v3b pairs (validate_v3.py: tests/data/v3, tests/data/v3b) and
prints the whole zoo's totals last: issue 29's three targets over every pair.

DIR holds ``pairs.json`` (the unprofiled step times of each pair's fault and fix, measured by
``bench/diagnosis/gpu_pairs.py`` on a GPU) and the fault traces. Each trace is analysed as an
aiprof capture whose ``meta.json`` carries the unprofiled step time measured before it, exactly
what ``aiprof run``/``attach`` record (``steps.before_median_ms``). For every pair it prints the
top cause, its predicted saving (share of the step) and the measured saving
((fault - fix) / fault, unprofiled), and for the healthy jobs their most severe cause.

Targets (docs/findings.md): the expected cause on top for every pair, predicted share within
1.5x of the measured one, no high or medium cause on the healthy jobs.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import validate_v3  # noqa: E402 (the v3 pairs, and the same three targets: one definition)

from aiprof.pipeline import build_report
from aiprof.trace.store import open_capture

RATIO_TARGET = 1.5


def _capture(tmp: Path, name: str, traces: list[str], src: Path, before_ms: list[float]) -> Path | None:
    """A capture directory (rank<R>/trace.json.gz + meta.json) for the given traces."""
    d = tmp / name
    for r, (t, ms) in enumerate(zip(traces, before_ms)):
        if not (src / t).exists():
            return None
        rd = d / f"rank{r}"
        rd.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / t, rd / "trace.json.gz")
        (rd / "meta.json").write_text(json.dumps({"schema": "aiprof.capture/1", "steps": {"before_median_ms": ms}}))
    return d


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "data" / "diagnosis")
    man = json.loads((src / "pairs.json").read_text())
    os.environ.setdefault("AIPROF_PROGRESS", "never")
    rows, fails = [], 0
    tallies: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, p in man["pairs"].items():
            fault = p["traces"].get("fault") or p["traces"].get("job")
            traces = fault if isinstance(fault, list) else [fault]
            if "per_rank_ms" in p:
                before = [p["per_rank_ms"][str(r)]["fault"] for r in range(len(traces))]
            else:
                before = [p.get("fault_ms") or p.get("step_ms")] * len(traces)
            cap = _capture(Path(tmp), name, traces, src, before)
            if cap is None:
                rows.append((name, p.get("expect"), "(trace not in this set)", None, p.get("measured_share"), None, "skip"))
                continue
            rep = build_report(open_capture(str(cap)))
            causes = rep["causes"]
            top = causes[0] if causes else None
            if p.get("expect") is None:  # a healthy job (bar a cause another pair measured on it: "measured")
                measured = set(p.get("measured", []))
                worst = next((c for c in causes if c["severity"] in ("high", "medium") and c["code"] not in measured),
                             None)
                ok = worst is None
                tallies.append({"quiet": ok})
                rows.append((name, "(healthy)", f"{worst['code']} {worst['severity']}" if worst else
                             (f"{top['code']} {top['severity']}" if top else "none"),
                             worst["saving"]["share"] if worst else None, None, None, "ok" if ok else "FAIL"))
                fails += not ok
                continue
            pred = top["saving"]["share"] if top else 0.0
            meas = p["measured_share"]
            ratio = (pred / meas) if meas > 0 else None
            # a straggler's cause may be the mechanism found on that rank (its data loading, say)
            right = bool(top) and (top["code"] == p["expect"] or (p["expect"] == "STRAGGLER" and
                                                                 "straggler" in top["evidence"]))
            within = ratio is not None and 1 / RATIO_TARGET <= ratio <= RATIO_TARGET
            ok = right and within
            tallies.append({"first": right, "within": within})
            got = (top["code"] + (f" (rank {top['rank']})" if "straggler" in top["evidence"] else "")) if top else "none"
            rows.append((name, p["expect"], got, pred, meas, ratio, "ok" if ok else "FAIL"))
            fails += not ok
    print(f"{'pair':20s} {'expected cause':24s} {'top cause':24s} {'predicted':>9s} {'measured':>9s} {'ratio':>6s}")
    for name, exp, got, pred, meas, ratio, verdict in rows:
        f = (lambda x: f"{100 * x:8.1f}%" if x is not None else f"{'':>9s}")
        r = f"{ratio:6.2f}" if ratio is not None else " " * 6
        print(f"{name:20s} {exp!s:24s} {got:24s} {f(pred)} {f(meas)} {r}  {verdict}")
    print(f"{len(rows) - fails - sum(r[-1] == 'skip' for r in rows)} ok, {fails} failed, "
          f"{sum(r[-1] == 'skip' for r in rows)} skipped")
    print(validate_v3.totals(tallies))
    if len(sys.argv) > 1:
        return 1 if fails else 0
    print()
    bad, v3 = validate_v3.run()
    print(f"\nthe whole zoo ({len(tallies) + len(v3)} rows): {validate_v3.totals(tallies + v3)}")
    return 1 if fails or bad else 0


if __name__ == "__main__":
    sys.exit(main())
