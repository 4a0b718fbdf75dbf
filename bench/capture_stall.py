"""Step times around the end of a capture: does the trace flush stall the training thread?

GPT-2 small (transformers, built from its config: random weights, nothing downloaded) on CUDA,
bf16 autocast, batch 8 x 1024 tokens (about 61 ms per step on one H200), trained under the
aiprof agent of this process. Every step ends with a device synchronize (as a loop that logs
its loss does) and is timed on the host. Each round: --before steps, a kernels capture of
--iterations steps (after --skip), then steps until the export has finished and at least
--after steps have passed. Kept per round: the step-time series around the capture's end and

- ``before_ms``: median step before the capture;
- ``stop_step_ms``: the step whose optimizer step ends the capture (it runs Kineto's
  ``stop_trace`` on the training thread, but in ``offthread`` mode);
- ``first_after_ms``, ``after_max_ms``: the next step, and the slowest of the --after steps;
- ``excess_ms``: the sum over the --after steps of (step - before_ms), positive parts;
- ``stall_ms``: (stop step - before_ms) + excess_ms: everything the capture's end cost the job,
  and ``flush_ms`` = stall_ms - stop_ms: what the flush added to Kineto's own stop_trace (the
  writer can land in the stop step itself: the export thread may take the GIL as it starts);
- the agent's own timings from meta.json's ``export`` (stop_ms, fork_ms, write_ms, release_ms).

Five modes, rotated round by round so drift hits all alike, after one warm-up capture that is
not counted (CUPTI initialisation and the stopper's build):

- ``offthread``: as shipped: the training thread only detaches the profiler; the export thread
  stops CUPTI's recording once the GPU is done, finishes the profiler and writes the trace with
  the GIL released (agent/offstop.py);
- ``offthread-late``: the same, but CUPTI records on until torch's ``disableProfiler`` stops it
  (after its op post-processing: the job's next steps pay CUPTI's per-call cost meanwhile);
- ``auto``: the path before (``AIPROF_OFFSTOP=0``): Kineto's ``stop_trace`` on the training
  thread, then a forked child writes a large trace, the export thread a small one
  (agent/traceout.py; meta.json's ``export.why`` says which and why);
- ``fork``: stop_trace, then always the forked child;
- ``thread``: stop_trace, then always the agent's export thread (Kineto's save holds the GIL
  while it writes).

Results: a table on stdout and ``$OUT/capture_stall.json`` (or --out).

    python bench/capture_stall.py                            # GPU
    python bench/capture_stall.py --model tiny --rounds 1    # CPU smoke run
    python bench/capture_stall.py --model deep --rounds 2    # CPU, a large trace from cheap steps
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/overhead.py: the shared workloads

import overhead
import torch

from aiprof.agent.bootstrap import ensure_agent
from aiprof.agent import offstop
from aiprof.agent.capture import OFFSTOP_ENV
from aiprof.protocol import CaptureRequest
from aiprof.agent.traceout import CUPTI_FIRST_ENV, FORK_ENV

MAX_EXTRA_STEPS = 2000  # steps run after --after while waiting for an export to finish
SERIES_BEFORE = 5  # steps before the stop step kept in each round's series
# bench mode -> the environment that selects it
MODES = {"offthread": {OFFSTOP_ENV: "1", CUPTI_FIRST_ENV: "1", FORK_ENV: "auto"},
         "offthread-late": {OFFSTOP_ENV: "1", CUPTI_FIRST_ENV: "0", FORK_ENV: "auto"},
         "auto": {OFFSTOP_ENV: "0", FORK_ENV: "auto"}, "fork": {OFFSTOP_ENV: "0", FORK_ENV: "1"},
         "thread": {OFFSTOP_ENV: "0", FORK_ENV: "0"}}
BUILD_WAIT_S = 180.0  # the stopper's first build (seconds; minutes on a loaded 2-core machine)
DEEP_LAYERS = 120  # --model deep: ~2,000 profiled ops per step, a GPU-sized trace from a CPU job


def build(model: str, device: str):
    """Return train_step() for the chosen workload (GPT-2 and the MLP: bench/overhead.py's)."""
    if model != "deep":
        return overhead.build(model, device)
    torch.manual_seed(0)  # "deep": many small ops per step, a large trace from a cheap CPU step
    width, batch = 64, 8
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(DEEP_LAYERS)]).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step() -> None:
        x = torch.randn(batch, width, device=device)
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def one_round(agent, step, device: str, mode: str, name: str, args, caps: str) -> dict:
    """Steps before, one capture, steps until its export finished; the series and summaries."""
    os.environ.update(MODES[mode])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: list[float] = []
    counts: list[int] = []

    def run(n: int) -> None:
        for _ in range(n):
            counts.append(agent.tracker.count)  # the iteration number the agent gives this step
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)

    run(args.before)
    req = CaptureRequest(out=caps, capture_id=name, what="kernels", skip=args.skip,
                         iterations=args.iterations).normalised()
    err = agent.driver.submit(req)
    if err:
        raise SystemExit(f"capture not armed: {err}")
    run(args.skip + args.iterations)
    while agent.driver.state in ("armed", "recording") and len(times) < args.before + MAX_EXTRA_STEPS:
        run(1)
    stop_at = len(times)
    done_at = None
    while len(times) < stop_at + args.after or (done_at is None and len(times) < stop_at + MAX_EXTRA_STEPS):
        run(1)
        if done_at is None and agent.driver.state == "idle":
            done_at = len(times)
    meta_path = os.path.join(caps, name, f"rank{agent.driver.info.get('rank', 0)}", "meta.json")
    if not os.path.exists(meta_path):
        raise SystemExit(f"capture {name} failed: {agent.driver.last_result}")
    with open(meta_path) as f:
        meta = json.load(f)
    last = meta["steps"]["captured"][-1]
    i_stop = counts.index(last)  # this step's optimizer step ran step_end(last): stop_trace
    before = statistics.median(times[2:args.before])
    after = times[i_stop + 1:i_stop + 1 + args.after]
    ms = [round(t * 1e3, 3) for t in times]
    excess = sum(max(0.0, t - before) for t in after)
    stall = max(0.0, times[i_stop] - before) + excess
    return {
        "mode": mode, "capture_id": name, "captured": meta["steps"]["captured"], "export": meta.get("export"), "stop": meta.get("stop"),
        "trace_json_bytes": meta.get("trace_json_bytes"),
        "before_ms": round(before * 1e3, 3),
        "stop_step_ms": ms[i_stop],
        "first_after_ms": ms[i_stop + 1],
        "after_max_ms": round(max(after) * 1e3, 3),
        "after_median_ms": round(statistics.median(after) * 1e3, 3),
        "excess_ms": round(excess * 1e3, 3),
        "stall_ms": round(stall * 1e3, 3),
        "flush_ms": round(stall * 1e3 - ((meta.get("export") or {}).get("stop_ms") or 0.0), 3),
        "first_after_vs_before": round(times[i_stop + 1] / before, 4),
        "after_max_vs_before": round(max(after) / before, 4),
        "steps_until_export_done": None if done_at is None else done_at - i_stop - 1,
        "series_ms": ms[max(0, i_stop - SERIES_BEFORE):i_stop + 1 + args.after],
        "series_stop_index": min(SERIES_BEFORE, i_stop),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt2", "tiny", "deep"], default="gpt2")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode (after one warm-up capture)")
    ap.add_argument("--before", type=int, default=20, help="steps timed before each capture")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=5, help="iterations each capture records")
    ap.add_argument("--after", type=int, default=30, help="steps timed after the capture's last step")
    ap.add_argument("--pretouch-gb", type=int, default=0, help="touch this much host memory first (VMs that grow memory lazily)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for capture_stall.json (default $OUT)")
    ap.add_argument("--keep", action="store_true", help="keep the captures (in --out/captures)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = args.model if device == "cuda" or args.model != "gpt2" else "tiny"
    if device == "cpu":
        torch.set_num_threads(1)
    if args.pretouch_gb > 0:
        bytearray(args.pretouch_gb << 30)
    os.makedirs(args.out, exist_ok=True)
    caps = os.path.join(args.out, "captures") if args.keep else tempfile.mkdtemp(prefix="aiprof-stall-")
    rt = tempfile.mkdtemp(prefix="aiprof-stall-rt-")
    step = build(model, device)
    for _ in range(10):  # allocator, cuBLAS handles, autotuning
        step()
    agent = ensure_agent("bench", rt)
    rounds = [one_round(agent, step, device, "offthread", "warmup", args, caps)]
    rounds[0]["mode"] = "warmup"
    if offstop.wait(BUILD_WAIT_S) is None:  # the warm-up armed its build; the rounds must not race it
        print(f"offthread stop unavailable: {offstop.unavailable() or 'still building'}", file=sys.stderr)
    names = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(names) - set(MODES))
    if unknown or not names:
        raise SystemExit(f"capture_stall.py: unknown --modes {unknown or args.modes!r}; choose from {', '.join(MODES)}")
    for r in range(args.rounds):
        for mode in names[r % len(names):] + names[:r % len(names)]:
            rounds.append(one_round(agent, step, device, mode, f"r{r}-{mode}", args, caps))
            print(f"round {r} {mode} done", file=sys.stderr, flush=True)
    summary = {}
    for mode in names:
        rs = [x for x in rounds if x["mode"] == mode]
        summary[mode] = {k: round(statistics.median(x[k] for x in rs), 4) for k in
                         ("before_ms", "stop_step_ms", "first_after_ms", "after_max_ms", "excess_ms", "stall_ms",
                          "flush_ms", "first_after_vs_before", "after_max_vs_before")}
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    res = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": model,
        "torch": torch.__version__, "transformers": tf_version, "python": platform.python_version(),
        "args": vars(args), "summary_median_over_rounds": summary, "rounds": rounds,
    }
    path = os.path.join(args.out, "capture_stall.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    if not args.keep:
        shutil.rmtree(caps, ignore_errors=True)
    shutil.rmtree(rt, ignore_errors=True)
    print(f"{res['device']}, {model}, torch {res['torch']}; step times in ms; 'stop' is the step that ends the capture")
    print(f"{'round':12s} {'before':>8s} {'stop':>8s} {'next':>8s} {'max after':>9s} {'stall':>8s} {'flush':>8s}"
          f" {'next/bef':>8s} {'max/bef':>8s}   export (ms): stop fork write release")
    for x in rounds:
        e = x["export"] or {}
        print(f"{x['capture_id']:12s} {x['before_ms']:8.2f} {x['stop_step_ms']:8.2f} {x['first_after_ms']:8.2f}"
              f" {x['after_max_ms']:9.2f} {x['stall_ms']:8.1f} {x['flush_ms']:8.1f} {x['first_after_vs_before']:8.4f}"
              f" {x['after_max_vs_before']:8.4f}   {e.get('how')}: {e.get('stop_ms')} {e.get('fork_ms')}"
              f" {e.get('write_ms')} {e.get('release_ms')} ({e.get('why')})")
    for mode, sm in summary.items():
        print(f"median {mode:6s}: next/before {sm['first_after_vs_before']}, max after/before "
              f"{sm['after_max_vs_before']}, stall {sm['stall_ms']} ms of which flush {sm['flush_ms']} ms, "
              f"stop step {sm['stop_step_ms']} ms (before {sm['before_ms']} ms)")
    for x in rounds:
        print(f"series {x['capture_id']} (stop at index {x['series_stop_index']}): {x['series_ms']}")
    print("results:", path)


if __name__ == "__main__":
    main()
