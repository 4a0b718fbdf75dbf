"""Per-call cost of a Frida probe (aiprof.native.engine) on a real process.

Builds a tiny C library and a driver with the system C compiler, then times N calls of a
7-argument function without a hook, with the probe engine's hook, and after unhooking, in the
same process (each figure: the median of ROUNDS rounds). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LIB = r"""
#include <stdint.h>
uint64_t probe_add(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e, uint64_t f, uint64_t g)
{ return a + b + c + d + e + f + g; }
"""
MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
uint64_t probe_add(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
int main(void) {
  char buf[32]; uint64_t s = 0;
  printf("ready\n"); fflush(stdout);
  while (fgets(buf, sizeof buf, stdin)) {
    long n = atol(buf); struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) s += probe_add(i, 1, 2, 3, 4, 5, 6);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.3f %lu\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n, (unsigned long) s);
    fflush(stdout);
  }
  return 0;
}
"""
ROUNDS = 5


def build(d: str) -> str:
    with open(os.path.join(d, "lib.c"), "w") as f:
        f.write(LIB)
    with open(os.path.join(d, "main.c"), "w") as f:
        f.write(MAIN)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", os.path.join(d, "libprobebench.so"), os.path.join(d, "lib.c")], check=True)
    exe = os.path.join(d, "bench")
    subprocess.run(["cc", "-O1", "-o", exe, os.path.join(d, "main.c"), f"-L{d}", "-lprobebench", f"-Wl,-rpath,{d}"], check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    from aiprof.native.engine import ProbeEngine, frida_status
    from aiprof.native.probes import parse_probes

    with tempfile.TemporaryDirectory() as d:
        p = subprocess.Popen([build(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdin is not None
        p.stdout.readline()

        def per_call() -> float:
            vals = []
            for _ in range(ROUNDS):
                p.stdin.write(f"{args.calls}\n")
                p.stdin.flush()
                vals.append(float(p.stdout.readline().split()[0]))
            return statistics.median(vals)

        base = per_call()
        spec = parse_probes({"libraries": [{"name": "bench", "library": "libprobebench.so", "symbols": [
            {"symbol": "probe_add", "args": [{"index": i, "name": f"a{i}", "type": "u64"} for i in range(7)]}]}]}, "bench")
        eng = ProbeEngine(p.pid, spec)
        eng.start()
        hooked = []
        recorded = 0
        for _ in range(ROUNDS):
            p.stdin.write(f"{args.calls}\n")
            p.stdin.flush()
            hooked.append(float(p.stdout.readline().split()[0]))
            recorded += len(eng.drain())
        stats = eng.stats()
        eng.close()
        after = per_call()
        p.stdin.close()
        p.wait(timeout=30)
    res = {"frida": frida_status()[1], "calls_per_round": args.calls, "rounds": ROUNDS,
           "ns_per_call_unhooked": base, "ns_per_call_hooked": statistics.median(hooked),
           "ns_per_call_after_unhook": after, "hook_cost_ns": statistics.median(hooked) - base,
           "recorded": recorded, "lost": stats.get("lost")}
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
