"""A GPU-only export at scale (issue 18): N kernel events and no CUDA runtime events.

Replicates the real kernels of tests/data/gpt2_train_stall.json.gz (H200) until the trace holds
``--kernels`` of them, each copy shifted past the previous one, with no host events at all (what
a GPU-only export looks like), then runs ``aiprof analyze --json`` on it in a fresh process and
prints its exit code, wall time and what the report found. Before the fix this ended in
``KeyError: 'ts'`` (analysis/launch.py via breakdown.step_breakdown). Usage::

    python bench/gpu_only_export.py --kernels 1000000
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generate(path: Path, n: int) -> int:
    with gzip.open(ROOT / "tests" / "data" / "gpt2_train_stall.json.gz") as f:
        doc = json.load(f)
    kernels = [e for e in doc.pop("traceEvents") if e.get("cat") == "kernel"]
    lo = min(e["ts"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - lo + 100.0
    written = 0
    with open(path, "w") as f:
        f.write(json.dumps({k: v for k, v in doc.items() if k != "traceName"})[:-1] + ', "traceEvents": [\n')
        copy = 0
        while written < n:
            for e in kernels[: n - written]:
                c = dict(e, ts=round(e["ts"] + copy * span, 3))
                f.write(("" if written == 0 else ",\n") + json.dumps(c))
                written += 1
            copy += 1
        f.write("\n]}\n")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aiprof-gpu-only-") as d:
        path = Path(d) / "gpu_only.json"
        n = generate(path, args.kernels)
        mb = path.stat().st_size / 1e6
        print(f"generated {n:,} kernel events, no runtime events: {mb:,.0f} MB", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "aiprof", "analyze", "--json", str(path)], capture_output=True,
                             text=True, env=env, check=False)
        wall = time.perf_counter() - t0
        print(f"aiprof analyze: exit {res.returncode} in {wall:.1f} s")
        if res.returncode != 0:
            print(res.stderr[-3000:])
            raise SystemExit(1)
        r = json.loads(res.stdout)["ranks"][0]
        print(f"rows: {r['rows']}; steps: {len(r['steps'])} ({r['step_source']}); GPU busy "
              f"{r['summary'].get('gpu_busy_pct', 0):.1f}%; top kernel: {r['top_kernels'][0]['name'][:60]}")


if __name__ == "__main__":
    main()
