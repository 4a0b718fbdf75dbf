"""Per-rank analysis CPU of a git revision against the working tree, alternating, same reports.

Builds an N-rank capture with bench/scale.py's builder (a straggler at rank N - 3), ingests it
once (the stores are reused by every run), then runs, in alternation, a fresh process of each
aiprof (``--ref``'s ``src/``, exported with ``git archive``, and the working tree's) that
analyses the capture in that process (``SerialEngine``: the Ray engine's tasks, one after
another, so that the analyse phase's CPU is the tasks' own, with no worker contention). Prints
each run's analyse-phase CPU, the medians, the ratio and whether every report is the same
(canonical JSON hashed). Usage::

    python bench/analyse_ab.py --ref HEAD --ranks 20 --rounds 5
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one run, in a fresh process importing the aiprof under argv[1]
RUN = """
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files
files = find_trace_files([sys.argv[2]])
with engines.SerialEngine() as eng:
    t = time.process_time()
    rep = build_job_report(files, eng)
    cpu = time.process_time() - t
print(json.dumps({"sha": hashlib.sha256(json.dumps(rep, sort_keys=True).encode()).hexdigest()[:16],
                  "cpu_s": cpu, "analyse_cpu_s": eng.stats.by_phase["analyse"]["cpu_s"]}))
"""


def _bench_scale():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    mod = sys.modules["bench_scale"] = importlib.util.module_from_spec(spec)  # its pool pickles by name
    spec.loader.exec_module(mod)
    return mod


def export_src(ref: str, into: Path) -> Path:
    """``ref``'s src/ tree, written under ``into``."""
    data = subprocess.run(["git", "archive", ref, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_script(script: str, src: Path, *args: str) -> dict:
    """``script`` in a fresh process that imports the aiprof under ``src`` (its argv[1]; ``args``
    follow): the JSON object its last line prints."""
    out = subprocess.run([sys.executable, "-c", script, str(src), *args], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "AIPROF_PROGRESS": "never"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(src: Path, capture: Path) -> dict:
    return run_script(RUN, src, str(capture))


def ab_arguments(description: str, ranks: int) -> argparse.ArgumentParser:
    """The options of an A/B bench over a built capture (this one's and bench/driver_ab.py's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--ref", default="HEAD", help="the git revision compared with the working tree")
    ap.add_argument("--template", default="ddp2", choices=("ddp2", "ddp4"))
    ap.add_argument("--ranks", type=int, default=ranks)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", help="where the capture is built (default: a temporary folder)")
    return ap


def main() -> int:
    args = ab_arguments(__doc__.split("\n")[0], 20).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        capture, straggler = _bench_scale().build(args.template, args.ranks, work / "capture")
        sides = {"ref": export_src(args.ref, work / "ref"), "this": ROOT / "src"}
        run(sides["this"], capture)  # ingests: every run below reuses the stores
        got: dict[str, list[dict]] = {k: [] for k in sides}
        for i in range(args.rounds):
            for name, src in sides.items():
                r = run(src, capture)
                got[name].append(r)
                print(f"round {i + 1} {name:4}: analyse CPU {r['analyse_cpu_s']:.2f} s  all {r['cpu_s']:.2f} s  "
                      f"report {r['sha']}", flush=True)
        med = {k: statistics.median(r["analyse_cpu_s"] for r in v) for k, v in got.items()}
        same = len({r["sha"] for v in got.values() for r in v}) == 1
        print(f"{args.template}, {args.ranks} ranks (straggler {straggler}), {args.rounds} rounds; load "
              f"{os.getloadavg()[0]:.1f}: analyse CPU median ref ({args.ref}) {med['ref']:.2f} s, this "
              f"{med['this']:.2f} s, this/ref {med['this'] / med['ref']:.3f}; same report: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
