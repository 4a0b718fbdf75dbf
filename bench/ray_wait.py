"""The driver's cost of collecting N finished Ray results: one `ray.wait` per result (what
engines.RayEngine.map did) against a wait that also takes every other result already in.

Every task has finished before the loop starts (the case of many fast workers), so the figures
are the driver's own: CPU seconds and wall per phase of N results.

    python bench/ray_wait.py --tasks 1024 --rounds 3
"""
from __future__ import annotations

import argparse
import time

import ray

RESULT_BYTES = 200_000  # about a rank's summary (a report section and its causes)


@ray.remote(num_cpus=0)
def _summary(i: int) -> bytes:
    return bytes(RESULT_BYTES)


def collect(n: int, batched: bool) -> tuple[float, float]:
    """CPU seconds and wall seconds the driver takes to collect ``n`` finished results."""
    refs = [_summary.remote(i) for i in range(n)]
    ray.wait(refs, num_returns=len(refs))
    c0, t0 = time.process_time(), time.perf_counter()
    pending = refs
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        if batched and pending:
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        ray.get(ready)
    return time.process_time() - c0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = {"one wait per result": [], "batched": []}
    for _ in range(args.rounds):  # alternating
        for name, batched in (("one wait per result", False), ("batched", True)):
            rows[name].append(collect(args.tasks, batched))
    ray.shutdown()
    print(f"{args.tasks} finished results, {args.rounds} alternating rounds (median, min-max)")
    base = sorted(w for _, w in rows["one wait per result"])[args.rounds // 2]
    for name, r in rows.items():
        cpu, wall = sorted(c for c, _ in r), sorted(w for _, w in r)
        mid = args.rounds // 2
        print(f"  {name:20s} CPU {cpu[mid]:.2f} s ({cpu[0]:.2f}-{cpu[-1]:.2f})  wall {wall[mid]:.2f} s "
              f"({wall[0]:.2f}-{wall[-1]:.2f})  {base / wall[mid]:.1f}x")


if __name__ == "__main__":
    main()
