"""Shrink a validation trace for tests/data: drop the Python events *inside* pure-Python
functions (their callees: thousands of builtin calls), keeping the functions themselves.

    python bench/diagnosis/trim.py IN.json.gz OUT.json.gz FUNCTION [FUNCTION ...]
    python bench/diagnosis/trim.py IN.json.gz OUT.json.gz --keep-only TEXT [TEXT ...]

FUNCTION matches the end of a frame name (``": tokenize"``, ``": __getitem__"``). With
``--keep-only``, every Python event is dropped but those whose name contains one of the TEXTs
(the frames a test needs, e.g. ``run_backward`` and the script's own file). The result is
the same Kineto trace minus those events; the detectors see the same functions, the deflation
sees fewer events, so a trimmed trace's predicted savings differ from the original's, at times by
much: the 4-rank FSDP job over sockets (tests/data/v3b/fsdp_sockets_fault) has SLOW_INTERCONNECT at
34.4 % of a step untrimmed and 44.0 % trimmed (44.2 % measured). Report the full capture's figure
beside the trimmed one when they differ (tests/data/v3b/README.txt does).
"""
from __future__ import annotations

import gzip
import json
import sys


def trim(src: str, dst: str, functions: list[str], keep_only: list[str] | None = None) -> tuple[int, int]:
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    ev = doc["traceEvents"]
    if keep_only:
        keep = [e for e in ev if e.get("cat") != "python_function" or any(k in e.get("name", "") for k in keep_only)]
        doc["traceEvents"] = keep
        with gzip.open(dst, "wt", compresslevel=9) as f:
            json.dump(doc, f)
        return len(ev), len(keep)
    py = {e["args"]["Python id"]: e for e in ev if e.get("cat") == "python_function" and "Python id" in e.get("args", {})}
    roots = {i for i, e in py.items() if any(e.get("name", "").endswith(fn) for fn in functions)}
    drop = set()
    for i, e in py.items():
        p = e["args"].get("Python parent id")
        seen = 0
        while p is not None and p in py and seen < 10_000:
            if p in roots:
                drop.add(i)
                break
            p = py[p]["args"].get("Python parent id")
            seen += 1
    keep = [e for e in ev if not (e.get("cat") == "python_function" and e.get("args", {}).get("Python id") in drop)]
    doc["traceEvents"] = keep
    with gzip.open(dst, "wt", compresslevel=9) as f:
        json.dump(doc, f)
    return len(ev), len(keep)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        sys.exit(2)
    rest = sys.argv[3:]
    if rest[0] == "--keep-only":
        before, after = trim(sys.argv[1], sys.argv[2], [], rest[1:])
    else:
        before, after = trim(sys.argv[1], sys.argv[2], rest)
    print(f"{before} -> {after} events")
