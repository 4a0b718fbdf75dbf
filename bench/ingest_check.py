"""Equivalence check for ingest changes: are the tables bit-for-bit those of a saved baseline?

Reads every real trace under tests/data (whole, and cut into small chunks), the generated
benchmark trace when present (``bench/out/bench_*mb.json``, in one process and in two), and a
fixed set of hypothesis-made traces (well-formed and hostile, each read with the normal chunk
size and with tiny chunks). For each it records every table's columns (name, dtype, raw bytes;
string columns as codes and labels, so label order counts too), the top-level metadata and the
event count, or the one-line error for a refused file. ``--save`` writes that (with the
hypothesis inputs, so that ``--compare`` reads the very same bytes); ``--compare`` re-reads
everything with the current code and names each difference. Usage::

    python bench/ingest_check.py --save /tmp/before.pkl      # on the old code
    python bench/ingest_check.py --compare /tmp/before.pkl   # on the new code
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiprof.errors import TraceError  # noqa: E402
from aiprof.trace import kineto  # noqa: E402
from aiprof.trace.table import Strings  # noqa: E402

SMALL_CHUNK = 64 << 10  # real traces cut into many chunks: labels and rows merged across chunks
FUZZ_CHUNK = 512  # hypothesis traces are a few KB: this cuts them into several chunks
FUZZ_CASES = 300  # per strategy (hostile-or-not drawn, and well-formed only)


def dump(path: str, chunk: int = kineto.CHUNK_BYTES, workers: int = 1) -> tuple:
    """Everything ``read_trace`` returns for ``path``, as plain comparable values."""
    try:
        p = kineto.read_trace(path, chunk_bytes=chunk, workers=workers)
    except TraceError as exc:
        return ("error", exc.problem)  # without the path: the fuzz inputs live in a temporary folder
    tables = {}
    for name, t in p.tables.items():
        cols = {}
        for k, c in t.columns.items():
            if isinstance(c, Strings):
                cols[k] = ("str", c.codes.dtype.str, c.codes.tobytes(), list(c.labels))
            else:
                cols[k] = ("num", c.dtype.str, c.tobytes())
        tables[name] = cols
    return ("ok", p.n_events, p.meta, tables)


def _fuzz_inputs() -> list[bytes]:
    """FUZZ_CASES derandomized traces of each kind (the same strategies as tests/fuzz)."""
    from hypothesis import HealthCheck, given, settings

    from tests.fuzz.inputs import trace_file

    out: list[bytes] = []
    conf = settings(deadline=None, derandomize=True, database=None, max_examples=FUZZ_CASES,
                    suppress_health_check=list(HealthCheck))

    @conf
    @given(trace_file())
    def any_kind(data):
        out.append(data)

    @conf
    @given(trace_file(hostile=False))
    def well_formed(data):
        out.append(data)

    any_kind()
    well_formed()
    return out


def cases(fuzz: list[bytes], tmp: str):
    """(label, path, chunk, workers) of every read."""
    for p in sorted((ROOT / "tests" / "data").rglob("*.json.gz")):
        rel = str(p.relative_to(ROOT))
        yield rel, str(p), kineto.CHUNK_BYTES, 1
        yield rel + "@64k", str(p), SMALL_CHUNK, 1
    for p in sorted((ROOT / "bench" / "out").glob("bench_*mb.json")):
        yield p.name, str(p), kineto.CHUNK_BYTES, 1
        yield p.name + "@2workers", str(p), kineto.CHUNK_BYTES, 2
    for i, data in enumerate(fuzz):
        path = os.path.join(tmp, f"fuzz{i}.json")
        with open(path, "wb") as f:
            f.write(data)
        yield f"fuzz{i}", path, kineto.CHUNK_BYTES, 1
        yield f"fuzz{i}@{FUZZ_CHUNK}", path, FUZZ_CHUNK, 1


def diff(a: tuple, b: tuple) -> list[str]:
    """What differs between two dumps (empty: identical)."""
    if a[0] != b[0] or a[0] == "error":
        return [] if a == b else [f"{a[:2]} != {b[:2]}"]
    out = []
    if a[1] != b[1]:
        out.append(f"n_events {a[1]} != {b[1]}")
    if a[2] != b[2]:
        out.append(f"meta {a[2]} != {b[2]}")
    ta, tb = a[3], b[3]
    if list(ta) != list(tb):
        out.append(f"tables {list(ta)} != {list(tb)}")
    for name in ta.keys() & tb.keys():
        if list(ta[name]) != list(tb[name]):
            out.append(f"{name}: columns {list(ta[name])} != {list(tb[name])}")
        for col in ta[name].keys() & tb[name].keys():
            x, y = ta[name][col], tb[name][col]
            if x[:2] != y[:2]:
                out.append(f"{name}.{col}: kind/dtype {x[:2]} != {y[:2]}")
            elif x[2] != y[2]:
                n = np.frombuffer(x[2], x[1])
                m = np.frombuffer(y[2], y[1])
                where = np.nonzero(n != m)[0][:5] if len(n) == len(m) else f"length {len(n)} != {len(m)}"
                out.append(f"{name}.{col}: values differ (rows {where})")
            elif x[0] == "str" and x[3] != y[3]:
                out.append(f"{name}.{col}: labels differ ({len(x[3])} vs {len(y[3])})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", metavar="FILE", help="record the current code's output")
    g.add_argument("--compare", metavar="FILE", help="compare the current code's output with FILE")
    args = ap.parse_args()
    if args.save:
        fuzz = _fuzz_inputs()
        base: dict = {}
    else:
        with open(args.compare, "rb") as f:
            saved = pickle.load(f)
        fuzz, base = saved["fuzz"], saved["results"]
    results: dict = {}
    bad = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for label, path, chunk, workers in cases(fuzz, tmp):
            results[label] = r = dump(path, chunk, workers)
            if args.compare:
                if label not in base:
                    print(f"{label}: not in the baseline")
                    continue
                problems = diff(base[label], r)
                if problems:
                    bad += 1
                    print(f"DIFF {label}:\n  " + "\n  ".join(problems[:10]))
    n_ok = sum(1 for r in results.values() if r[0] == "ok")
    print(f"{len(results)} reads ({n_ok} with tables, {len(results) - n_ok} refused) in {time.perf_counter() - t0:.1f} s")
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump({"fuzz": fuzz, "results": results}, f)
        print(f"saved {args.save}")
    else:
        missing = base.keys() - results.keys()
        print(f"{bad} differ, {len(missing)} baseline reads missing")
        sys.exit(1 if bad or missing else 0)


if __name__ == "__main__":
    main()
