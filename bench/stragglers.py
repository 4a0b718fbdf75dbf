"""Straggler detection, side by side: aiprof vs HolisticTraceAnalysis on real multi-rank traces.

    python bench/stragglers.py      # needs `pip install HolisticTraceAnalysis` for the peer column

Ground truth: ddp2_slow1 (2 H200s) rank 1 and ddp4_slow2 (4 H200s) rank 2 run extra matmuls
every step, so the other ranks wait for them in all-reduce.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
CASES = {"ddp2_slow1": (1, sorted(DATA.glob("ddp2_slow1_rank*.json.gz"))),
         "ddp4_slow2": (2, sorted(DATA.glob("ddp4_slow2_rank*.json.gz")))}


def _aiprof(d: str) -> str:
    from aiprof.pipeline import build_report
    from aiprof.trace.store import open_capture

    f = [x for x in build_report(open_capture(d))["findings"] if x["code"] == "STRAGGLER_RANK"]
    return f"rank {f[0]['rank']}" if f else "none"


def _hta(d: str) -> str:
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return "HTA not installed"
    logging.disable(logging.WARNING)
    try:
        return f"ranks {list(TraceAnalysis(trace_dir=d).get_potential_stragglers())}"
    except Exception as exc:  # the peer's failure is the measurement
        return f"{type(exc).__name__}: {exc}"[:80]


def main() -> None:
    print(f"{'capture':12s} {'truth':>6s}  {'aiprof':12s} {'s':>5s}  {'HTA get_potential_stragglers':50s} {'s':>5s}")
    for name, (truth, files) in CASES.items():
        d = tempfile.mkdtemp(prefix=name)
        for f in files:
            shutil.copy(f, d)
        t = time.perf_counter()
        ours = _aiprof(d)
        t1 = time.perf_counter()
        peer = _hta(d)
        t2 = time.perf_counter()
        print(f"{name:12s} {truth:>6d}  {ours:12s} {t1 - t:5.1f}  {peer:50s} {t2 - t1:5.1f}")
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
