"""Scale-out benchmark: `aiprof analyze` on N-rank captures, Ray engine vs the in-process path.

Builds an N-rank capture from the real multi-rank traces in tests/data: every rank is a copy of
one of the job's normal ranks (cycling through them), time-shifted by its own clock offset and
stretched by its own clock drift (per-rank jitter), except one rank, a copy of the job's real
straggler, placed at rank ``N - 3``. Then, each run in a fresh process (`aiprof analyze --json
--stats`, cold: --no-cache):

- ``ray``: the embedded local Ray (aiprof starts it) with each of --workers CPUs
- ``local``: the in-process path (the baseline; skipped above --local-max ranks)
- ``head`` (with --head): a Ray head started once before the runs (`ray start --head`, the last
  --workers CPUs) and named with --cluster, as a user analysing one capture after another would
  keep it: no run starts or stops Ray

and prints wall time, the driver's peak RSS, the CPU the work took (Ray: summed over tasks;
in-process: the driver's), all processes' CPU as reaped, and whether the straggler is named
(the cross-rank analysis names exactly it, and the top cause is on it). Templates:

- ``ddp4``: tests/data/ddp4_slow2_rank{0..3} (4.4 MB JSON, 17.7 k events per rank; rank 2 is
  the straggler: 40 extra matmuls per step)
- ``ddp2``: tests/data/ddp2_slow1_rank{0,1} (29 MB JSON, 97 k events per rank; rank 1 is the
  straggler: 60 extra matmuls per step)

Usage::

    python bench/scale.py                                   # ddp4, N = 8, 64, 256, 1024
    python bench/scale.py --ranks 1024 --workers 4,8,16 --local-max 0    # scaling with workers
    python bench/scale.py --template ddp2 --ranks 1024 --local-max 0 --out $OUT   # ~30 MB ranks
    python bench/scale.py --ranks 1024 --workers 16,64 --compare ../base/src --warm   # before/after
    python bench/scale.py --template ddp2 --ranks 1024 --workers 16 --local-max 0 --head   # Ray kept running
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TEMPLATES = {
    "ddp4": {"normal": [DATA / f"ddp4_slow2_rank{r}.json.gz" for r in (0, 1, 3)],
             "straggler": DATA / "ddp4_slow2_rank2.json.gz"},
    "ddp2": {"normal": [DATA / "ddp2_slow1_rank0.json.gz"], "straggler": DATA / "ddp2_slow1_rank1.json.gz"},
}
CLOCK_OFFSET_US = 20_000.0  # each rank's clock is off by up to ±20 ms (hosts synchronised by NTP)
CLOCK_DRIFT = 2e-4  # and runs up to ±200 ppm fast or slow (per-rank jitter: ±10 µs over a 50 ms window)
_TIME = re.compile(rb'"(ts|dur)": (-?[0-9]+(?:\.[0-9]+)?)')


def _template_text(path: Path, world: int) -> tuple[bytes, float]:
    """The trace as JSON bytes with the rank as a placeholder and the world size set; and its
    first timestamp (µs)."""
    with gzip.open(path) as f:
        doc = json.load(f)
    dist = doc.setdefault("distributedInfo", {})
    dist["rank"] = "__RANK__"
    dist["world_size"] = world
    for pg in dist.get("pg_config") or []:
        pg["pg_size"], pg["ranks"] = world, list(range(world))
    t0 = min(float(e["ts"]) for e in doc["traceEvents"] if "ts" in e)
    return json.dumps(doc).encode(), t0


def _write_rank(args: tuple) -> None:
    """One synthetic rank: the template with its own clock offset and drift."""
    text, t0, rank, offset_us, drift, out = args

    def shift(m: re.Match) -> bytes:
        v = float(m.group(2))
        v = t0 + (v - t0) * (1 + drift) + offset_us if m.group(1) == b"ts" else v * (1 + drift)
        return b'"' + m.group(1) + b'": ' + f"{v:.3f}".encode()

    body = _TIME.sub(shift, text).replace(b'"__RANK__"', str(rank).encode())
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wb", compresslevel=1) as f:
        f.write(body)
    os.replace(tmp, out)


def build(template: str, n: int, work: Path, seed: int = 0, procs: int | None = None) -> tuple[Path, int]:
    """The N-rank capture folder (reused when already built with the same spec) and its straggler."""
    straggler = max(n - 3, 0)
    d = work / f"{template}_n{n}"
    spec = {"template": template, "ranks": n, "seed": seed, "straggler": straggler,
            "offset_us": CLOCK_OFFSET_US, "drift": CLOCK_DRIFT}
    spec_path = d / "spec.txt"  # not a trace: aiprof reads *.json(.gz) only
    if spec_path.exists() and json.loads(spec_path.read_text()) == spec:
        return d, straggler
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t = TEMPLATES[template]
    texts = {p: _template_text(p, n) for p in [*t["normal"], t["straggler"]]}
    rng = random.Random(seed)
    jobs = []
    for r in range(n):
        src = t["straggler"] if r == straggler else t["normal"][r % len(t["normal"])]
        text, t0 = texts[src]
        jobs.append((text, t0, r, rng.uniform(-CLOCK_OFFSET_US, CLOCK_OFFSET_US),
                     rng.uniform(-CLOCK_DRIFT, CLOCK_DRIFT), d / f"rank{r:05d}.json.gz"))
    with ProcessPoolExecutor(max_workers=procs or os.cpu_count()) as ex:
        list(ex.map(_write_rank, jobs, chunksize=4))
    spec_path.write_text(json.dumps(spec))
    return d, straggler


def _rm_stores(d: Path) -> None:
    for p in d.glob("*.aiprof"):
        shutil.rmtree(p, ignore_errors=True)


def _rm_results(d: Path) -> None:
    """The per-rank results kept in the stores (scale.results), the stores themselves left."""
    for p in d.glob("*.aiprof/results"):
        shutil.rmtree(p, ignore_errors=True)


# How a run finds what earlier runs left: nothing (every rank parsed and analysed), the stores
# only (parsed once, analysed again: the results removed), or the stores and every result.
COLD, STORES, RESULTS = "cold", "stores", "results"


def run(d: Path, engine: str, straggler: int, workers: int | None, timeout: int, src: Path = ROOT / "src",
        warm: str = COLD, address: str | None = None) -> dict:
    """`aiprof analyze` (imported from ``src``) on the capture in a fresh process; its figures.
    ``warm``: COLD (no store from an earlier run, --no-cache), STORES (the stores the previous
    run wrote, its results removed), RESULTS (both). What it writes is left for the next run.
    ``address``: a running Ray's (``--cluster``: no Ray started or stopped by the run)."""
    stats, report = d / f"stats-{engine}.txt", d / f"report-{engine}.txt"
    if warm == COLD:
        _rm_stores(d)
    elif warm == STORES:
        _rm_results(d)
    cmd = [sys.executable, "-c", "import sys; from aiprof.cli.main import main; sys.exit(main())", "analyze", str(d),
           *(["--cluster", address] if address else ["--engine", engine]), "--json", "--stats", str(stats)]
    cmd += ["--no-cache"] if warm == COLD else []
    if workers and engine == "ray" and not address:
        cmd += ["--workers", str(workers)]
    env = dict(os.environ, AIPROF_PROGRESS="never", PYTHONPATH=os.pathsep.join(
        p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        with open(report, "wb") as out:
            p = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"over {timeout} s"}
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        return {"engine": engine, "error": p.stderr.decode(errors="replace").strip().splitlines()[-1:]}
    st = json.loads(stats.read_text())
    with open(report, "rb") as f:
        rep = json.load(f)
    named = [s["straggler_rank"] for s in (rep.get("cross_rank") or {}).get("stragglers", [])]
    top = rep["causes"][0] if rep["causes"] else {}
    return {"engine": engine, "wall_s": round(wall, 2), "driver_peak_rss_mb": st["driver_peak_rss_mb"],
            "work_cpu_s": round(st["worker_cpu_s"] if engine == "ray" else st["driver_cpu_s"] + st["worker_cpu_s"], 1),
            "driver_cpu_s": st["driver_cpu_s"],
            "all_cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "phases": st.get("phases", {}), "driver": st.get("driver", {}), "stragglers_named": named,
            # the rest of the wall: the process's start, imports and exit (outside aiprof's own clock),
            # and what its clock saw that no phase or driver step did
            "outside_s": round(wall - st["wall_s"], 2),
            "unaccounted_s": round(st["wall_s"] - sum(v["wall_s"] for v in st.get("phases", {}).values())
                                   - sum(st.get("driver", {}).values()), 2),
            "top_cause": f"{top.get('code')}@{top.get('rank')} {100 * top.get('saving', {}).get('share', 0):.1f}%",
            "straggler_named": named == [straggler] and top.get("rank") == straggler,
            "report_mb": round(report.stat().st_size / 1e6, 1),
            # the document, canonical: a faster aiprof must give the same report as its baseline
            "report_sha": hashlib.sha256(json.dumps(rep, sort_keys=True).encode()).hexdigest()[:16]}


# A local Ray head started once for the --head runs: what a user analysing one capture after
# another would keep running (`ray start --head`), so that no run pays Ray's start and stop.
HEAD_PORT = 6391
RAY_CLI = "import sys; from ray.scripts.scripts import main; sys.exit(main())"


@contextlib.contextmanager
def ray_head(cpus: int) -> Iterator[str]:
    """`ray start --head` with ``cpus`` CPUs (its workers import the aiprof of this checkout), its
    address while the block runs, `ray stop` after (every Ray of this machine: a bench's own)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                        if p))
    tmp = Path(tempfile.mkdtemp(prefix="rayhead-"))  # short: Ray's socket paths under it are length-limited
    subprocess.run([sys.executable, "-c", RAY_CLI, "start", "--head", f"--num-cpus={cpus}", f"--port={HEAD_PORT}",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}"],
                   env=env, check=True, capture_output=True, timeout=300)
    try:
        yield f"127.0.0.1:{HEAD_PORT}"
    finally:
        subprocess.run([sys.executable, "-c", RAY_CLI, "stop", "--force"], env=env, capture_output=True, timeout=300)
        shutil.rmtree(tmp, ignore_errors=True)


def _use(phase: dict, workers: int) -> str:
    """How the phase used its workers: CPU in tasks, and time in tasks, as shares of the phase's
    wall time on every worker (the rest: workers idle, starting or between tasks)."""
    if phase.get("before_ray"):  # its wall counts from Ray's being up, its tasks from Ray's start
        return f" ({phase['before_ray']} of {phase['tasks']} tasks beside Ray's start)"
    if "task_wall_s" not in phase or not phase["wall_s"]:
        return ""
    slots = phase["wall_s"] * workers
    return f" (CPU {100 * phase['cpu_s'] / slots:.0f}%, in tasks {100 * phase['task_wall_s'] / slots:.0f}%)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="ddp4")
    ap.add_argument("--ranks", default="8,64,256,1024", help="comma-separated rank counts")
    ap.add_argument("--local-max", type=int, default=256, help="largest N also run in-process (the baseline)")
    ap.add_argument("--workers", default="", help="CPUs of the local Ray, comma-separated to compare (default: all)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--work", default=str(ROOT / "bench" / "out" / "scale"), help="where captures are built")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write results.json here")
    ap.add_argument("--keep", action="store_true", help="keep the built captures (reused by the next run)")
    ap.add_argument("--compare", metavar="SRC", help="also run the aiprof imported from SRC (a checkout's src/, "
                    "e.g. `git worktree add` of the baseline), alternating with this one, labelled 'base'")
    ap.add_argument("--head", action="store_true", help="also this aiprof on a Ray head started once before the runs "
                    "(ray start --head with the last --workers CPUs; --cluster): cold, then with the stores reused")
    ap.add_argument("--warm", action="store_true", help="after the cold runs, two more Ray runs of this aiprof: "
                    "'stores' reads the stores of its cold run (results removed), 'results' also every "
                    "per-rank result (a second analysis of the same capture)")
    args = ap.parse_args()
    work = Path(args.work)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    sweep = [int(w) for w in args.workers.split(",") if w] or [None]
    print(f"template {args.template}; {cpus} CPUs; Ray workers: {args.workers or cpus}; load {os.getloadavg()[0]:.1f}",
          flush=True)
    results = []
    with (ray_head(sweep[-1] or cpus) if args.head else contextlib.nullcontext()) as head:
        _runs(args, work, cpus, sweep, results, head)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scale_results.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


def _runs(args: argparse.Namespace, work: Path, cpus: int, sweep: list, results: list, head: str | None) -> None:
    """Every rank count's runs (main's plan), their figures appended to ``results`` and printed."""
    for n in (int(x) for x in args.ranks.split(",")):
        t0 = time.perf_counter()
        d, straggler = build(args.template, n, work)
        size = sum(p.stat().st_size for p in d.glob("*.json.gz"))
        print(f"\nN={n}: built {d} ({size / 1e6:.0f} MB gz) in {time.perf_counter() - t0:.0f} s; "
              f"straggler rank {straggler}", flush=True)
        srcs = [("this", ROOT / "src")] + ([("base", Path(args.compare))] if args.compare else [])
        # the head's runs after each cold pair of its worker count: in alternation with them
        plan = [(e, w, name, src, COLD) for w in sweep
                for e, name, src in [("ray", n_, s_) for n_, s_ in srcs]
                + ([("head", "this", ROOT / "src")] if args.head and w == sweep[-1] else [])]
        plan += [("local", None, name, src, COLD) for name, src in srcs]
        if args.warm and sweep:
            plan += [("ray", sweep[-1], "this", ROOT / "src", STORES), ("ray", sweep[-1], "this", ROOT / "src", RESULTS)]
        if args.head:
            plan += [("head", sweep[-1], "this", ROOT / "src", STORES)]
        last = None
        for engine, workers, name, src, warm in plan:
            if engine == "local" and n > args.local_max:
                print(f"  local   : skipped (N > --local-max {args.local_max})")
                continue
            if warm != COLD and last != ("this", engine):  # the stores of this aiprof's own cold run
                run(d, engine, straggler, workers, args.timeout, src, COLD, head if engine == "head" else None)
            last = (name, engine)
            r = run(d, engine, straggler, workers, args.timeout, src, warm, head if engine == "head" else None)
            r.update(ranks=n, template=args.template, gz_mb=round(size / 1e6), cpus=cpus, aiprof=name, warm=warm,
                     ray_workers=(workers or cpus) if engine in ("ray", "head") else None)
            results.append(r)
            label = (f"{engine}/{workers or cpus}" if engine in ("ray", "head") else engine) + \
                ("" if warm == COLD else f" {warm}")
            label += f" {name}" if args.compare else ""
            if "error" in r:
                print(f"  {label:14s}: FAILED {r['error']}", flush=True)
                continue
            driver = "  ".join(f"{k[:-2]} {v:.2f}" for k, v in r["driver"].items())
            driver += f"  | start+imports+exit {r['outside_s']:.2f}  other {r['unaccounted_s']:.2f}"
            # a baseline's report, for a warm run its own cold run's, for a run on the head the same
            # aiprof's on its embedded Ray: the same document
            if engine == "head" and warm == COLD:
                other, what = (lambda x: x["aiprof"] == name and x["engine"] == "ray"), "the embedded Ray's"
            elif warm == COLD:
                other, what = (lambda x: x["aiprof"] != name), "the other aiprof"
            else:
                other, what = (lambda x: x["aiprof"] == name and x["warm"] == COLD), "its cold run"
            same = [x["report_sha"] == r["report_sha"] for x in results[:-1]
                    if x.get("ranks") == n and "report_sha" in x and other(x)]
            label_same = f"  same report as {what}: {all(same)}" if same else ""
            phases = "  ".join(f"{k} {v['wall_s']:.1f}/{v['cpu_s']:.0f}" + _use(v, workers or cpus)
                               for k, v in r["phases"].items())
            print(f"  {label:14s}: wall {r['wall_s']:8.1f} s  driver peak RSS {r['driver_peak_rss_mb']:7.0f} MB  "
                  f"driver CPU {r['driver_cpu_s']:6.1f} s  work CPU {r['work_cpu_s']:7.1f} s  all CPU {r['all_cpu_s']:7.1f} s  "
                  f"straggler named: {r['straggler_named']} ({r['top_cause']})  report {r['report_mb']} MB{label_same}\n"
                  f"  {'':14s}  phases wall/CPU s: {phases}\n  {'':14s}  driver steps s: {driver or '-'}", flush=True)
        _rm_stores(d)
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
