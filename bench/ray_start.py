"""The embedded Ray's start and stop, three ways:

- ``runtime_env``: the workers' environment given as a runtime_env (what engines.RayEngine did)
- ``environ``: set in the environment the raylet inherits, stopped with ray.shutdown()
- ``engine``: engines.RayEngine itself: started as ``environ``, stopped by its close(), which
  kills Ray's autoscaler monitor before ray.shutdown() (engines._kill_monitor)

Per round and way: the start, then 8 one-CPU tasks that import aiprof's task module (the first
ingest tasks), then the stop; wall seconds of each. Rounds alternate.

    python bench/ray_start.py --rounds 3 [--cpus 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, logging, os, sys, time
import ray
way, cpus = sys.argv[1], int(sys.argv[2])
if way == "engine":
    sys.path.insert(0, os.environ["AIPROF_SRC"])
    from aiprof.scale import engines
# as engines.RayEngine does: aiprof's src, then what this process's PYTHONPATH holds (where Ray is
# installed there: the lent machines)
path = os.pathsep.join(p for p in (os.environ["AIPROF_SRC"], os.environ.get("PYTHONPATH", "")) if p)
env = {"PYTHONPATH": path, "AIPROF_INGEST_WORKERS": "1"}
kw = dict(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=512 << 20,
          logging_level=logging.ERROR, log_to_driver=False)
t0 = time.perf_counter()
if way == "runtime_env":
    ray.init(runtime_env={"env_vars": env}, **kw)
elif way == "engine":
    eng = engines.RayEngine(cpus=cpus)
    assert eng.cpus == cpus  # starts it
else:
    os.environ.update(env)
    ray.init(**kw)
t1 = time.perf_counter()

@ray.remote(num_cpus=1)
def first(i):
    import aiprof.scale.tasks  # noqa: F401
    return os.getpid()

ray.get([first.remote(i) for i in range(8)])
t2 = time.perf_counter()
eng.close() if way == "engine" else ray.shutdown()
print(json.dumps({"init": t1 - t0, "first_tasks": t2 - t1, "shutdown": time.perf_counter() - t2}))
"""


def once(way: str, cpus: int) -> dict:
    env = dict(os.environ)  # the workers get aiprof's src from `way` only: not on PYTHONPATH here
    src = os.path.join(ROOT, "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != src)
    env["AIPROF_SRC"] = src
    p = subprocess.run([sys.executable, "-c", CHILD, way, str(cpus)], capture_output=True, text=True, env=env,
                       timeout=300, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    ways = ("runtime_env", "environ", "engine")
    got: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for w in ways:
            got[w].append(once(w, args.cpus))
    mid = args.rounds // 2
    print(f"{args.cpus} CPUs, {args.rounds} alternating rounds: median (min-max) s")
    base = sorted(r["init"] + r["first_tasks"] for r in got[ways[0]])[mid]
    for w in ways:
        cols = []
        for k in ("init", "first_tasks", "shutdown"):
            v = sorted(r[k] for r in got[w])
            cols.append(f"{k} {v[mid]:.2f} ({v[0]:.2f}-{v[-1]:.2f})")
        tot = sorted(r["init"] + r["first_tasks"] for r in got[w])[mid]
        print(f"  {w:12s} " + "  ".join(cols) + f"  init+first {tot:.2f}  {base / tot:.2f}x")


if __name__ == "__main__":
    main()
