"""Step-time cost of CUPTI PM sampling at 100 µs on GPT-2 training, alone and with kernel tracing.

One fresh process per measurement, so that no mode inherits another's state (CUPTI attached,
allocator, clocks). Each round runs every mode once, in an order rotated from round to round, so that drift (clocks,
temperature, other tenants) hits every mode alike; the ratios are paired within a round.

Modes:

- ``none``: plain training, no agent, no profiler;
- ``pm``: the PM sampler process alone (``agent.pmsidecar.PmSidecar``, as ``agent/hwmon.py``
  runs it), no profiler; started after warm-up, its set-up and stop outside the timed steps;
- ``kernels``: an aiprof capture ``--what kernels`` (Kineto kernel tracing);
- ``kernels+hw``: ``--what kernels,hw`` without PM (NVML/GPM polling only);
- ``kernels+pm``: ``--what kernels,hw --hw-pm-interval-us 100`` (what a user asks for);
- ``kernels+pm-nvml1``: the same with ``--hw-interval-ms 10000``: NVML/psutil read at the start
  and the end only, so that the job process's 100 ms NVML polling is told from PM sampling.

Per process: ``--warmup`` untimed steps, then every step timed with a device synchronize before
and after. With PM counters a capture records once its sampler runs (the steps before are run
untimed, ``armed_steps``); its first ``--drop`` recorded steps are not kept either. Per mode: the
median over rounds of each process's median step; ``x none`` and ``x kernels`` are medians of
the per-round ratios.

    python bench/pm_overhead.py --rounds 4                  # GPT-2 small on CUDA (transformers)
    python bench/pm_overhead.py --model tiny --rounds 1 --steps 5 --warmup 2 --drop 2   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

MODES = ("none", "pm", "kernels", "kernels+hw", "kernels+pm", "kernels+pm-nvml1")
# One process's result line on stdout: the driver reads only this.
RESULT_PREFIX = "PM_OVERHEAD_RESULT "
# A GPT-2 process imports torch and transformers, warms up and exports a capture in ~30 s on an
# H200: six times that is a stuck process, which is recorded and skipped.
CHILD_TIMEOUT_S = 180.0
# Steps run while a capture is armed before it gives up waiting to record (a GPT-2 step is
# 30-100 ms: minutes, past capture.PM_READY_MAX_S).
MAX_ARMED_STEPS = 3000


def _capture(mode: str, args, step, device: str, out: str) -> dict:
    """Time steps inside one agent capture; return the step times kept and what the capture says."""
    from aiprof.agent.bootstrap import ensure_agent
    from aiprof.protocol import CaptureRequest
    from overhead import timed

    agent = ensure_agent("pm-overhead", tempfile.mkdtemp(prefix="aiprof-pmovh-rt-"))
    what = "kernels" if mode == "kernels" else "kernels,hw"
    req = CaptureRequest(out=out, capture_id=mode.replace("+", "_"), what=what, skip=1,
                         iterations=args.drop + args.steps,
                         hw_pm_interval_us=100 if mode.startswith("kernels+pm") else 0,
                         hw_interval_ms=10_000 if mode == "kernels+pm-nvml1" else 100).normalised()
    err = agent.driver.submit(req)
    if err is not None:
        return {"error": f"capture refused: {err}"}
    # With PM counters the recording starts once the sampler runs (capture.PM_READY_MAX_S): the
    # steps before it are the job's, untimed here; then the capture's own steps are timed.
    armed = 0
    while agent.driver.state == "armed" and armed < MAX_ARMED_STEPS:
        timed(step, 1, device)
        armed += 1
    ts = timed(step, args.drop + args.steps, device)
    t_wait = time.monotonic()
    while agent.driver.state != "idle" and time.monotonic() - t_wait < 120:
        time.sleep(0.05)
    res: dict = {"steps_s": ts[args.drop:], "dropped_s": sum(ts[:args.drop]), "armed_steps": armed,
                 "capture_dir": os.path.join(out, req.capture_id, "rank0")}
    meta_path = os.path.join(out, req.capture_id, "rank0", "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        res["error"] = f"no capture meta ({exc})"
        return res
    pm = (meta.get("hw") or {}).get("pm") or {}
    res["pm"] = {k: pm.get(k) for k in ("ok", "error", "rows", "gap_us", "setup_ms", "stop_ms", "columns", "stats")}
    return res


def gpu_facts(rank_dir: str, top: int = 6) -> dict:
    """What the GPU did in a capture (read after the timed steps, outside them): kernel time per
    recorded step, the mean duration of the longest kernels by name, and the clocks NVML (hw.csv)
    and PM (pm.csv.gz) saw. Tells a slower GPU (clocks, kernels) from a slower host."""
    import csv
    import gzip

    facts: dict = {}
    try:
        with gzip.open(os.path.join(rank_dir, "trace.json.gz"), "rt") as f:
            events = json.load(f).get("traceEvents", [])
        by_name: dict[str, list[float]] = {}
        steps = 0
        for e in events:
            if e.get("cat") == "kernel":
                by_name.setdefault(e.get("name", "?"), []).append(float(e.get("dur", 0)))
            elif e.get("name", "").startswith("ProfilerStep#"):
                steps += 1
        total = sum(sum(v) for v in by_name.values())
        facts["kernel_ms_per_step"] = round(total / 1e3 / max(steps, 1), 3)
        facts["steps"] = steps
        longest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        facts["kernel_mean_us"] = {k[:60]: round(statistics.mean(v), 2) for k, v in longest}
    except (OSError, ValueError) as exc:
        facts["error"] = f"trace: {exc}"
    try:
        with open(os.path.join(rank_dir, "hw.csv")) as f:
            clk = [float(r["value"]) for r in csv.DictReader(f) if r["metric"] == "sm_clock_mhz"]
        if clk:
            facts["nvml_sm_clock_mhz"] = {"median": statistics.median(clk), "min": min(clk), "n": len(clk)}
    except OSError:
        pass
    try:
        with gzip.open(os.path.join(rank_dir, "pm.csv.gz"), "rt") as f:
            clk = [float(r["pm_gpc_clock_hz"]) / 1e6 for r in csv.DictReader(f) if r.get("pm_gpc_clock_hz")]
        if clk:
            facts["pm_gpc_clock_mhz"] = {"median": statistics.median(clk), "min": min(clk), "n": len(clk)}
    except (OSError, KeyError):
        pass
    return facts


def _pm_alone(args, step, device: str) -> dict:
    """Time steps with the PM sampler alone running."""
    import numpy as np
    import torch
    from aiprof.agent.capture import CaptureDriver
    from aiprof.agent.pmsidecar import PmSidecar
    from overhead import timed

    try:
        dev = torch.cuda.current_device() if device == "cuda" else 0
        sampler = PmSidecar(CaptureDriver._device_uuid(dev), dev, args.interval_us)
        sampler.wait_ready()
        sampler.start()
    except Exception as exc:  # noqa: BLE001 (recorded: the bench goes on)
        return {"error": f"PM sampler did not start: {type(exc).__name__}: {exc}"}
    time.sleep(0.05)  # the first decode period, so that the timed steps are all sampled
    ts = timed(step, args.steps, device)
    try:
        got = sampler.stop()
    except Exception as exc:  # noqa: BLE001
        return {"steps_s": ts, "error": f"PM stop: {type(exc).__name__}: {exc}"}
    t0 = got.t0.astype(np.int64)
    gaps = np.diff(t0) / 1e3 if len(t0) > 1 else np.zeros(1)
    span_s = (t0[-1] - t0[0]) / 1e9 if len(t0) > 1 else 0.0
    return {"steps_s": ts, "pm": {"ok": True, "rows": int(len(t0)), "columns": list(got.columns),
                                  "gap_us": {"median": float(np.median(gaps)), "p99": float(np.percentile(gaps, 99)),
                                             "max": float(gaps.max())},
                                  "sampled_s": round(span_s, 3), "timed_s": round(sum(ts), 3),
                                  "stats": {k: v for k, v in got.stats.items() if isinstance(v, (int, float))}}}


def _segment(mode: str, args, step, device: str, tag: str) -> dict:
    """Time one mode's steps in this process; its result (or why there is none)."""
    from overhead import timed

    try:
        if mode == "none":
            res = {"steps_s": timed(step, args.steps, device)}
        elif mode == "pm":
            res = _pm_alone(args, step, device)
        else:
            res = _capture(mode, args, step, device, tempfile.mkdtemp(prefix=f"aiprof-pmovh-{tag}-"))
    except Exception as exc:  # noqa: BLE001 (one line for the driver, not a traceback)
        res = {"error": f"{type(exc).__name__}: {exc}"}
    res["mode"] = mode
    if res.get("steps_s"):
        res["median_ms"] = statistics.median(res["steps_s"]) * 1e3
    return res


def child(args) -> None:
    """One measurement: the mode named by ``--child`` (or, for ``all``, every round of every
    mode in this one process); prints one result line."""
    sys.path.insert(0, HERE)
    import torch
    from overhead import build, timed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    step = build(args.model if device == "cuda" else "tiny", device)
    timed(step, args.warmup, device)  # allocator, cuBLAS handles, autotuning
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if args.child != "all":
        res = _segment(args.child, args, step, device, "x")
        res["device"] = name
        print(RESULT_PREFIX + json.dumps(res, default=str), flush=True)
        return
    modes = [m for m in args.modes.split(",") if m]
    rounds = []
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: each mode leads once
        got = {m: _segment(m, args, step, device, f"r{r}") for m in order}
        for m in order:
            got[m]["device"] = name
            print(f"round {r} {m:11s} " + (f"{got[m]['median_ms']:8.2f} ms" if "median_ms" in got[m] else "    -   ")
                  + (f"  error: {got[m]['error']}" if got[m].get("error") else "")
                  + (f"  pm rows {(got[m].get('pm') or {}).get('rows')}" if (got[m].get("pm") or {}).get("rows") else ""),
                  file=sys.stderr, flush=True)
        rounds.append(got)
    print(RESULT_PREFIX + json.dumps({"mode": "all", "rounds": rounds}, default=str), flush=True)


def run_child(mode: str, args) -> dict:
    """Run one measurement process and return its result (or why there is none)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--drop", str(args.drop),
           "--interval-us", str(args.interval_us), "--modes", args.modes, "--rounds", str(args.rounds)]
    limit = CHILD_TIMEOUT_S * (args.rounds * len(args.modes.split(",")) if mode == "all" else 1)
    if mode == "all" and args.max_seconds:
        limit = min(limit, args.max_seconds)
    t0 = time.monotonic()
    try:
        # the one-process child's rounds go straight to our stderr, so a run cut short keeps them
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if mode == "all" else subprocess.PIPE,
                           text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {limit:.0f} s"}
    wall = time.monotonic() - t0
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            res = json.loads(line[len(RESULT_PREFIX):])
            res["wall_s"] = round(wall, 1)
            res["rc"] = p.returncode  # a crash at exit (after the result) still shows here
            return res
    tail = (p.stderr or p.stdout or "").strip().splitlines()[-3:]
    return {"mode": mode, "error": f"rc {p.returncode}, no result: {' | '.join(tail)[:400]}", "wall_s": round(wall, 1)}


def summarise(rounds: list[dict[str, dict]], modes: list[str]) -> list[dict]:
    """Per mode: median step, and the per-round ratios vs none and vs kernels, paired by round."""
    rows = []
    for mode in modes:
        meds = [r[mode]["median_ms"] for r in rounds if "median_ms" in r.get(mode, {})]
        row: dict = {"mode": mode, "processes": len(meds),
                     "step_ms": round(statistics.median(meds), 3) if meds else None,
                     "per_round_ms": [round(m, 2) for m in meds]}
        for base in ("none", "kernels"):
            ratios = [r[mode]["median_ms"] / r[base]["median_ms"] for r in rounds
                      if "median_ms" in r.get(mode, {}) and "median_ms" in r.get(base, {})]
            row[f"x_{base}"] = round(statistics.median(ratios), 4) if ratios else None
            row[f"x_{base}_per_round"] = [round(x, 4) for x in ratios]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt2", "tiny"], default="gpt2")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="timed steps kept per process")
    ap.add_argument("--warmup", type=int, default=15, help="untimed steps first")
    ap.add_argument("--drop", type=int, default=15, help="a capture's first steps not kept (start, PM set-up)")
    ap.add_argument("--interval-us", type=int, default=100, help="PM sampling interval of mode pm")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="start no round that would end past this (0: no limit)")
    ap.add_argument("--prewarm", action="store_true",
                    help="run one untimed PM process first: it resolves the chip's metrics into the cache "
                         "(seconds the first time on a machine), which a capture's PM set-up then reads")
    ap.add_argument("--one-process", action="store_true",
                    help="every round of every mode in one process (paired segments: what differs between "
                         "processes, cuBLAS's and the allocator's choices, cancels out; PM sampling runs in "
                         "a sampler process per capture, so it repeats in a process)")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    ap.add_argument("--child", choices=MODES + ("all",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}")
    if args.prewarm:
        res = run_child("pm", args)
        print(f"prewarm: {res.get('error') or 'metrics resolved'} ({res.get('wall_s')} s)", file=sys.stderr, flush=True)
    rounds: list[dict[str, dict]] = []
    t_begin = time.monotonic()
    if args.one_process:
        res = run_child("all", args)
        if res.get("error"):
            print(f"one process: {res['error']}", file=sys.stderr)
        rounds = res.get("rounds") or []
    for r in range(0 if args.one_process else args.rounds):
        spent = time.monotonic() - t_begin
        if r and args.max_seconds and spent * (r + 1) / r > args.max_seconds:
            print(f"stopping after {r} rounds ({spent:.0f} s): another would pass --max-seconds", file=sys.stderr)
            break
        order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: each mode leads once
        got: dict[str, dict] = {}
        for mode in order:
            got[mode] = run_child(mode, args)
            res = got[mode]
            pm = res.get("pm") or {}
            print(f"round {r} {mode:11s} " + (f"{res['median_ms']:8.2f} ms" if "median_ms" in res else "    -   ")
                  + (f"  pm rows {pm.get('rows')} gap {pm.get('gap_us')}" if pm.get("rows") else "")
                  + (f"  pm error: {pm['error']}" if pm.get("error") else "")
                  + (f"  error: {res['error']}" if res.get("error") else "")
                  + f"  ({res.get('wall_s')} s)", file=sys.stderr, flush=True)
        rounds.append(got)
    for r, got in enumerate(rounds):  # after every timed step: reading traces costs the job nothing
        for mode in modes:
            d = (got.get(mode) or {}).get("capture_dir")
            if d:
                got[mode]["gpu"] = gpu_facts(d)
                print(f"round {r} {mode:11s} gpu {json.dumps(got[mode]['gpu'])}", file=sys.stderr, flush=True)
    rows = summarise(rounds, modes)
    print(f"{'mode':12s} {'step ms':>9s} {'x none':>8s} {'x kernels':>10s}  per round (ms)")
    for row in rows:
        fmt = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
        print(f"{row['mode']:12s} {row['step_ms'] if row['step_ms'] is not None else '-':>9} {fmt(row['x_none']):>8s} "
              f"{fmt(row['x_kernels']):>10s}  {row['per_round_ms']}  x kernels per round {row['x_kernels_per_round']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "rounds": rounds}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
