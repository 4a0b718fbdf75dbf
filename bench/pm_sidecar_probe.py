"""Can a PM sampler in a process of its own sample a GPU that another process trains on?

Issue 33 item 2. In the job's process, a second PM session after Kineto finalised CUPTI fails
(CUPTI_ERROR_UNKNOWN). A sampler process per GPU would keep a CUPTI of its own for the whole
job. Two roles, run as two processes on one GPU:

    python bench/pm_sidecar_probe.py job --seconds 40 --log job.jsonl [--kineto-every 6]
    python bench/pm_sidecar_probe.py sampler --windows 6 --seconds 2 --pause 2 --init cuinit

``job`` alternates ``BUSY_MS`` of matmuls with ``IDLE_MS`` of sleep, so the GPU's activity is a
known square wave; it logs each step's unix start and end. With ``--kineto-every N`` it also runs
a torch.profiler capture (CUPTI activity tracing, torn down at its end as aiprof's captures do)
every N seconds in the job's process.

``sampler`` opens PM sessions one after another (``--windows``), each ``--seconds`` long with
``--pause`` between them. ``--init`` says how the process brings up CUDA before CUPTI:
``cuinit`` (the driver only, no context: no GPU memory), ``context`` (a primary context via
torch), ``none``. Per window it prints the rows, the sample gap, the mean SM activity in the
job's busy and idle phases (from the job's log), and its own GPU memory.

``report`` joins both logs: the job's step time while the sampler samples vs while it waits.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

#: The job's square wave: long enough for ~100 PM samples a phase at 100 µs.
BUSY_MS = 30
IDLE_MS = 20


def job(args: argparse.Namespace) -> int:
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 0.5:  # calibrate matmuls per BUSY_MS
        a @ b
        torch.cuda.synchronize()
        n += 1
    per = max(1, int(n * BUSY_MS / 500))
    end = time.time() + args.seconds
    next_kineto = time.time() + args.kineto_every if args.kineto_every else None
    with open(args.log, "w") as log:
        log.write(json.dumps({"matmuls_per_step": per, "busy_ms": BUSY_MS, "idle_ms": IDLE_MS}) + "\n")
        while time.time() < end:
            if next_kineto and time.time() >= next_kineto:
                from torch.profiler import ProfilerActivity, profile

                k0 = time.time()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        for _ in range(per):
                            a @ b
                        torch.cuda.synchronize()
                        time.sleep(IDLE_MS / 1e3)
                n_events = len(prof.events())
                log.write(json.dumps({"kineto": [k0, time.time()], "events": n_events}) + "\n")
                next_kineto = time.time() + args.kineto_every
                continue
            s0 = time.time()
            for _ in range(per):
                a @ b
            torch.cuda.synchronize()
            s1 = time.time()
            time.sleep(IDLE_MS / 1e3)
            log.write(json.dumps({"busy": [s0, s1], "end": time.time()}) + "\n")
    return 0


def _own_gpu_mib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("PROBE_NVML_INDEX", "0")))
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) + pynvml.nvmlDeviceGetGraphicsRunningProcesses(h):
            if p.pid == os.getpid():
                return round((p.usedGpuMemory or 0) / 2**20, 1)
        return 0.0
    except Exception as exc:  # noqa: BLE001 (a probe's answer)
        return f"{type(exc).__name__}: {exc}"  # type: ignore[return-value]


def sampler(args: argparse.Namespace) -> int:
    import numpy as np

    t0 = time.perf_counter()
    if args.init == "cuinit":
        from aiprof.agent.pmsidecar import init_driver

        init_driver()
    elif args.init == "context":
        import torch

        torch.zeros(1, device="cuda")
    init_s = time.perf_counter() - t0
    from aiprof.agent.pmsampling import PmSampler

    out = open(args.log, "w") if args.log else sys.stdout
    for w in range(args.windows):
        t0 = time.perf_counter()
        try:
            pm = PmSampler(0, args.interval_us)
            setup = time.perf_counter() - t0
            pm.start()
            u0 = time.time()
            time.sleep(args.seconds)
            u1 = time.time()
            got = pm.stop()
        except Exception as exc:  # noqa: BLE001 (the probe's answer)
            out.write(json.dumps({"window": w, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
            out.flush()
            time.sleep(args.pause)
            continue
        gaps = np.diff(got.t0.astype(np.int64)) / 1e3 if len(got.t0) > 1 else np.zeros(1)
        # CUPTI ns -> unix ns by the clock pair taken at start
        c = got.clock[0]
        unix_ns = got.t0.astype(np.int64) - int(c["cupti_ns"]) + int(c["unix_ns"])
        sm = got.values[:, got.columns.index("pm_sm_active_pct")] if "pm_sm_active_pct" in got.columns else None
        rec = {"window": w, "init": args.init, "init_s": round(init_s, 3), "setup_s": round(setup, 3),
               "sampling": [u0, u1], "rows": len(got.t0), "gap_median_us": float(np.median(gaps)),
               "gap_p99_us": float(np.percentile(gaps, 99)), "reset": pm.reset, "own_gpu_mib": _own_gpu_mib(),
               "sm_mean": round(float(sm.mean()), 2) if sm is not None and len(sm) else None,
               "columns": got.columns}
        np.savez_compressed(f"{args.log or 'sampler'}.w{w}.npz", unix_ns=unix_ns, sm=sm if sm is not None else np.zeros(0))
        out.write(json.dumps(rec) + "\n")
        out.flush()
        time.sleep(args.pause)
    return 0


def report(args: argparse.Namespace) -> int:
    import numpy as np

    steps, kin = [], []
    with open(args.job) as f:
        head = json.loads(f.readline())
        for line in f:
            r = json.loads(line)
            if "busy" in r:
                steps.append((r["busy"][0], r["busy"][1], r["end"]))
            elif "kineto" in r:
                kin.append(r)
    wins = [json.loads(line) for line in open(args.sampler)]
    ok = [w for w in wins if "sampling" in w]
    print(json.dumps({"job": head, "steps": len(steps), "kineto_captures": len(kin),
                      "kineto_events": [k["events"] for k in kin], "windows": len(wins),
                      "window_errors": [w["error"] for w in wins if "error" in w]}))
    s = np.array(steps)

    def inside(t: np.ndarray) -> np.ndarray:
        m = np.zeros(len(t), bool)
        for w in ok:
            m |= (t >= w["sampling"][0]) & (t <= w["sampling"][1])
        return m

    if len(s):
        busy_ms = (s[:, 1] - s[:, 0]) * 1e3
        on = inside(s[:, 0]) & inside(s[:, 2])
        first, last = (ok[0]["sampling"][0], ok[-1]["sampling"][1]) if ok else (0, 0)
        off = ~inside(s[:, 0]) & ~inside(s[:, 2]) & (s[:, 0] > first - 3) & (s[:, 2] < last + 3)
        print(json.dumps({"busy_ms_sampling": {"n": int(on.sum()), "median": round(float(np.median(busy_ms[on])), 3) if on.any() else None},
                          "busy_ms_not_sampling": {"n": int(off.sum()), "median": round(float(np.median(busy_ms[off])), 3) if off.any() else None}}))
    for w in ok:
        z = np.load(f"{args.sampler}.w{w['window']}.npz")
        t = z["unix_ns"] / 1e9
        sm = z["sm"]
        in_busy = np.zeros(len(t), bool)
        in_idle = np.zeros(len(t), bool)
        for b0, b1, e in steps:
            in_busy |= (t >= b0 + 0.002) & (t <= b1 - 0.002)
            in_idle |= (t >= b1 + 0.003) & (t <= e - 0.003)
        print(json.dumps({"window": w["window"], "rows": w["rows"], "gap_median_us": w["gap_median_us"],
                          "gap_p99_us": w["gap_p99_us"], "setup_s": w["setup_s"], "own_gpu_mib": w["own_gpu_mib"],
                          "sm_busy_phase": round(float(sm[in_busy].mean()), 1) if in_busy.any() else None,
                          "sm_idle_phase": round(float(sm[in_idle].mean()), 1) if in_idle.any() else None,
                          "n_busy": int(in_busy.sum()), "n_idle": int(in_idle.sum())}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role", required=True)
    j = sub.add_parser("job")
    j.add_argument("--seconds", type=float, default=40)
    j.add_argument("--log", required=True)
    j.add_argument("--kineto-every", type=float, default=0)
    s = sub.add_parser("sampler")
    s.add_argument("--windows", type=int, default=6)
    s.add_argument("--seconds", type=float, default=2.0)
    s.add_argument("--pause", type=float, default=2.0)
    s.add_argument("--interval-us", type=int, default=100)
    s.add_argument("--init", choices=("cuinit", "context", "none"), default="cuinit")
    s.add_argument("--log", default="")
    r = sub.add_parser("report")
    r.add_argument("--job", required=True)
    r.add_argument("--sampler", required=True)
    args = ap.parse_args()
    return {"job": job, "sampler": sampler, "report": report}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
