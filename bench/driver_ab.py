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

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyse_ab  # noqa: E402 - the A/B plumbing: the capture, the baseline's src/, a fresh process

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


def run(src: Path, capture: Path, mode: str = "run") -> dict:
    return analyse_ab.run_script(RUN, src, str(capture), mode)


def main() -> int:
    args = analyse_ab.ab_arguments(__doc__.split("\n")[0], 1024).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        capture, straggler = analyse_ab._bench_scale().build(args.template, args.ranks, work)
        sides = {"ref": analyse_ab.export_src(args.ref, Path(tmp) / "ref"), "this": ROOT / "src"}
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
