"""Fuzz campaign: many random and hostile trace files through ``aiprof analyze``; count outcomes.

Uses the strategies and the property of tests/fuzz/inputs.py (the unit tests run a few hundred
derandomized examples of the same). Every case must end in a report (with a complete store) or
one line on stderr with exit 2 (and no store); anything else counts as a traceback and is
printed (the first few in full). Usage::

    python bench/fuzz_inputs.py --cases 5000            # random seed each run
    python bench/fuzz_inputs.py --cases 5000 --seed 1   # reproducible

Prints: cases tried, reports, one-line errors, tracebacks; the most common error messages; and
which tables the analysed reports had (how deep the fuzz reached).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]


def _inputs():
    spec = importlib.util.spec_from_file_location("fuzz_inputs", ROOT / "tests" / "fuzz" / "inputs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=None, help="fixed seed (default: random)")
    ap.add_argument("--show", type=int, default=3, help="tracebacks to print in full")
    args = ap.parse_args()
    fz = _inputs()
    counts: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    tables: collections.Counter = collections.Counter()
    failures: list = []

    @settings(max_examples=args.cases, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(st.data())
    def campaign(data):
        o = fz.check_cli(data.draw(fz.trace_file()))
        counts[o.kind] += 1
        if o.kind == "error":
            # the message without the temp path and numbers: which kinds of errors the fuzz met
            msg = o.stderr.strip().split(": ", 3)[-1]
            errors[re.sub(r"\d+", "N", re.sub(r"'.*?'|\".*?\"|`.*?`", "…", msg))[:90]] += 1
        elif o.kind == "report":
            tables[len(o.tables)] += 1
        else:
            failures.append(o)

    if args.seed is not None:
        campaign = seed(args.seed)(campaign)
    t0 = time.perf_counter()
    campaign()
    dt = time.perf_counter() - t0
    tried = sum(counts.values())
    print(f"cases tried: {tried} in {dt:.0f} s ({tried / dt:.1f}/s)")
    print(f"reports: {counts['report']}  one-line errors (exit 2): {counts['error']}  tracebacks: {counts['traceback']}")
    print("tables per analysed report (count: reports): " + ", ".join(f"{k}: {v}" for k, v in sorted(tables.items())))
    print("most common errors:")
    for msg, n in errors.most_common(12):
        print(f"  {n:6d}  {msg}")
    for o in failures[: args.show]:
        print("-" * 80)
        print(o.detail[-4000:])
        print(o.stderr[-1000:])
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
