"""The driver's own time at N ranks, a git revision against the working tree, alternating.

What issue 34 asks to be small at 1,024 ranks: everything `aiprof analyze` does besides its
tasks and Ray's start and stop. Builds an N-rank capture with bench/scale.py's builder, computes
every task's result once (kept beside each rank's store, under a fixed code key that both trees
read: the results of one code stand for the other's, as long as the result types did not change),
then runs, in alternation, a fresh process of each aiprof (``--ref``'s ``src/``, exported with
``git archive``, and the working tree's) that imports what `aiprof analyze` imports, builds the
report from the kept results (``build_job_report`` on the in-process engine: no task runs) and
encodes it as JSON. Prints each run's import, report and encode seconds (wall) and CPU, the
driver steps' (match, compare, assemble), the medians, the ratio and whether every report is the
same (canonical JSON hashed). Usage::

    python bench/driver_ab.py --ref HEAD --ranks 1024 --rounds 5 --work bench/out/driver
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_KEY = "bench/driver_ab"  # the results' code key both trees use (scale.results.code_version)

# one run, in a fresh process importing the aiprof under argv[1]; argv[3]: "fill" computes the
# results missing (on the local Ray when it is there), "run" only reads them
RUN = """
import hashlib, json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
sys.path.insert(0, sys.argv[1])
import aiprof.cli.analyze  # what `aiprof analyze` imports before its work
from aiprof.report import json_report
from aiprof.scale import engines, results
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files
results.code_version = lambda: %r
t1, c1 = time.perf_counter(), time.process_time()
files = find_trace_files([sys.argv[2]])
clock = {}
fill = sys.argv[3] == "fill"
eng = engines.RayEngine() if fill and engines.ray_available() else engines.SerialEngine()
with eng:
    rep = build_job_report(files, eng, timings=clock, reuse=True, keep=fill)
    ran = sum(p["tasks"] for p in eng.stats.by_phase.values())
t2, c2 = time.perf_counter(), time.process_time()
blob = json_report.encode(rep)
t3, c3 = time.perf_counter(), time.process_time()
print(json.dumps({"sha": hashlib.sha256(json.dumps(rep, sort_keys=True).encode()).hexdigest()[:16],
                  "tasks_run": ran, "import_s": t1 - t0, "report_s": t2 - t1, "encode_s": t3 - t2,
                  "cpu_s": c3 - c0, "wall_s": t3 - t0, "mb": len(blob) / 1e6,
                  **{k: round(v, 3) for k, v in clock.items()}}))
""" % CODE_KEY


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = sys.modules[f"bench_{name}"] = importlib.util.module_from_spec(spec)  # pools pickle by name
    spec.loader.exec_module(mod)
    return mod


def run(src: Path, capture: Path, mode: str = "run") -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, str(src), str(capture), mode], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "AIPROF_PROGRESS": "never"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="HEAD", help="the git revision compared with the working tree")
    ap.add_argument("--template", default="ddp2", choices=("ddp2", "ddp4"))
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", help="where the capture is built and kept (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        capture, straggler = _bench("scale").build(args.template, args.ranks, work)
        sides = {"ref": _bench("analyse_ab").export_src(args.ref, Path(tmp) / "ref"), "this": ROOT / "src"}
        filled = run(sides["this"], capture, "fill")  # every result, once: every run below reads them
        print(f"results: {filled['tasks_run']} tasks run", flush=True)
        got: dict[str, list[dict]] = {k: [] for k in sides}
        for i in range(args.rounds):
            for name, src in sides.items():
                r = run(src, capture)
                if r["tasks_run"]:
                    raise SystemExit(f"{name} ran {r['tasks_run']} tasks: its results' types differ from the other's")
                got[name].append(r)
                print(f"round {i + 1} {name:4}: wall {r['wall_s']:.2f} s (import {r['import_s']:.2f}, report "
                      f"{r['report_s']:.2f}, encode {r['encode_s']:.2f})  CPU {r['cpu_s']:.2f} s  match "
                      f"{r['match_s']:.2f}  compare {r['compare_s']:.2f}  assemble {r['assemble_s']:.2f}  "
                      f"report {r['sha']} {r['mb']:.1f} MB", flush=True)
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall_s", "cpu_s", "report_s", "assemble_s")}
               for k, v in got.items()}
        same = len({r["sha"] for v in got.values() for r in v}) == 1
        print(f"{args.template}, {args.ranks} ranks (straggler {straggler}), {args.rounds} rounds; load "
              f"{os.getloadavg()[0]:.1f}; medians, ref ({args.ref}) -> this:")
        for f in ("wall_s", "cpu_s", "report_s", "assemble_s"):
            print(f"  {f:11s} {med['ref'][f]:.3f} -> {med['this'][f]:.3f}  ({med['this'][f] / med['ref'][f]:.3f}x)")
        print(f"  same report: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
