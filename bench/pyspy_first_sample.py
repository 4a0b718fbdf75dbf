"""How long after py-spy prints "Sampling process" does its first --native sample come, on an
idle or a loaded host? (The native sidecar used to start the capture at that line; on a loaded
2-core host the capture then had no stacks of the job: the CI failure of stop 36.)

    python bench/pyspy_first_sample.py [--busy N] [--runs R]

A job whose loop calls a function named for the current 100 ms of its life (b0, b1, ...) runs
while py-spy samples it; the first bucket in py-spy's output is when its first sample was taken.
``--busy N`` runs N busy loops beside it. Prints one line per run: seconds from py-spy's start to
its line, and to its first sample; and what the sidecar's wait (native.sidecar.first_sample_taken)
returned, started at the line.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

from aiprof.native.sidecar import first_sample_taken
from aiprof.tools import find_py_spy

JOB = """
import sys, time
T0 = float(sys.argv[1])
ns = {}
for k in range(600):
    exec(f"def b{k}(t):\\n    x = t\\n    for _ in range(200): x = x + 1\\n    return x", ns)
import torch
t = torch.zeros(64)
while True:
    k = int((time.time() - T0) * 10)
    if k >= 600: break
    ns[f"b{k}"](t)
"""


def one(out: str) -> tuple[float, float, float | None, float, int]:
    t0 = time.time()
    job = subprocess.Popen([sys.executable, "-c", JOB, str(t0)])
    try:
        time.sleep(4)  # torch imported, the loop running
        t_start = time.time()
        # --idle: every sample is written, also one py-spy judges idle (a thread it finds off-CPU)
        spy = subprocess.Popen([find_py_spy(), "record", "--native", "--idle", "--threads", "--format", "raw", "--rate", "100",
                                "--pid", str(job.pid), "--output", out], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
        for line in spy.stdout:
            if "Sampling process" in line or "times a second" in line:
                break
        t_line = time.time()
        waited = first_sample_taken(job.pid, spy.pid, time.monotonic() + 30)
        t_waited = time.time()
        time.sleep(3)
    finally:
        job.kill()
        job.wait()
    tail = spy.stdout.read()  # "Samples: N Errors: M" once py-spy saw the job go
    spy.wait(timeout=30)
    m = re.search(r"Samples: (\d+) Errors: (\d+)", tail)
    errors = int(m.group(2)) if m else -1
    buckets = collections.Counter()
    with open(out) as f:
        for ln in f:
            m = re.search(r"b(\d+) \(<string>", ln)
            if m:
                buckets[int(m.group(1))] += 1
    first = min(buckets) / 10 if buckets else float("nan")
    return t_line - t_start, first - (t_start - t0), waited, t_waited - t_start, errors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        with tempfile.TemporaryDirectory() as d:
            for r in range(a.runs):
                line_s, first_s, waited, ready_s, errors = one(os.path.join(d, f"{r}.raw"))
                print(f"run {r + 1} busy={a.busy}: line at {line_s:.2f} s, first sample at {first_s:.2f} s "
                      f"(±0.1), the sidecar's wait ended at {ready_s:.2f} s"
                      + ("" if waited is not None else " (gave up)") + f"; py-spy's errors: {errors}", flush=True)
    finally:
        for p in busy:
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
