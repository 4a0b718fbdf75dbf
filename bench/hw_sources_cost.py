"""Step-time cost of each NVML/GPM/psutil source that ``--what hw`` polls, one at a time.

``bench/pm_overhead.py`` found the NVML/GPM sampler (``agent/hwmon.py``, every 100 ms) costing
GPT-2 training more than CUPTI PM sampling at 100 µs. This finds which call: in one process,
segments of ``--steps`` timed steps alternate between no polling and one source polled by a
thread every ``--interval-ms`` (as the sampler does), ``--rounds`` times with the order rotated.
Per source: the median step over rounds, the median per-round ratio to ``none``, and the
source's own call time (median, max). With ``--kineto`` every segment, ``none`` included, runs
inside a torch.profiler session tracing CPU and CUDA activity (as an aiprof capture does): the
host side of a traced GPT-2 step is near its GPU time, so host stalls that a plain step hides
show there.

    python bench/hw_sources_cost.py --rounds 4          # GPT-2 small on CUDA (transformers)
    python bench/hw_sources_cost.py --model tiny --rounds 1 --steps 5   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)


def sources(cuda_index: int) -> dict:
    """name -> a zero-argument call that takes one reading of that source (what hwmon calls)."""
    import psutil

    from aiprof.agent.hwmon import HwSampler, _Gpu

    proc = psutil.Process()

    def host() -> None:
        psutil.cpu_percent(None)
        proc.cpu_percent(None)
        psutil.virtual_memory()
        proc.memory_info()

    src: dict = {"psutil": host}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    except Exception as exc:  # noqa: BLE001 (a CPU machine: psutil only)
        print(f"NVML not available ({type(exc).__name__}: {exc}): psutil only", file=sys.stderr)
        return src
    N = pynvml
    gpu = _Gpu(N, h, "gpu")
    src["nvml_util"] = lambda: N.nvmlDeviceGetUtilizationRates(h)
    src["nvml_clock"] = lambda: N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)
    src["nvml_power"] = lambda: N.nvmlDeviceGetPowerUsage(h)
    src["nvml_mem"] = lambda: N.nvmlDeviceGetMemoryInfo(h)
    src["nvml_nvlink_fields"] = lambda: gpu._nvlink([], 0)
    if gpu.gpm_ids:
        def gpm() -> None:
            gpu.gpm_prev_t = 0.0  # every call samples (the sampler's own 100 ms rule aside)
            gpu._gpm([], 0)
        src["gpm"] = gpm
    src["pcie_throughput"] = lambda: N.nvmlDeviceGetPcieThroughput(h, N.NVML_PCIE_UTIL_TX_BYTES)
    hw = HwSampler(100, [N.nvmlDeviceGetUUID(h)], pm_interval_us=0, cuda_index=cuda_index)
    hw._setup()
    src["sampler_all"] = hw.sample_once
    return src


class Poller:
    """Calls ``fn`` every ``interval`` s on a thread and keeps each call's duration."""

    def __init__(self, fn, interval: float) -> None:
        self.fn, self.interval, self.calls = fn, interval, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                self.fn()
            except Exception:  # noqa: BLE001 (an unsupported call: timed all the same)
                pass
            self.calls.append(time.perf_counter() - t0)
            self.stop.wait(self.interval)

    def __enter__(self) -> "Poller":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt2", "tiny"], default="gpt2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval-ms", type=float, default=100.0)
    ap.add_argument("--kineto", action="store_true", help="run every segment under torch.profiler (CPU + CUDA)")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    import torch

    from overhead import build, timed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = build(args.model if device == "cuda" else "tiny", device)
    timed(step, 10, device)
    src = sources(torch.cuda.current_device() if device == "cuda" else 0)
    names = ["none"] + list(src)
    meds: dict[str, list[float]] = {n: [] for n in names}

    def segment() -> list[float]:
        if not args.kineto:
            return timed(step, args.steps, device)
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts):
            return timed(step, args.steps, device)

    calls: dict[str, list[float]] = {n: [] for n in src}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if name == "none":
                meds[name].append(statistics.median(segment()))
                continue
            with Poller(src[name], args.interval_ms / 1e3) as p:
                ts = segment()
            meds[name].append(statistics.median(ts))
            calls[name].extend(p.calls)
        print(f"round {r} done", file=sys.stderr, flush=True)
    rows = []
    for name in names:
        ratios = [m / b for m, b in zip(meds[name], meds["none"])]
        c = calls.get(name) or [0.0]
        rows.append({"source": name, "step_ms": round(statistics.median(meds[name]) * 1e3, 3),
                     "x_none": round(statistics.median(ratios), 4), "x_none_per_round": [round(x, 4) for x in ratios],
                     "call_ms_median": round(statistics.median(c) * 1e3, 3), "call_ms_max": round(max(c) * 1e3, 3),
                     "calls": len(calls.get(name) or [])})
    print(f"{'source':20s} {'step ms':>8s} {'x none':>7s} {'call ms (median / max)':>24s}  per round")
    for row in rows:
        print(f"{row['source']:20s} {row['step_ms']:8.2f} {row['x_none']:7.4f} "
              f"{row['call_ms_median']:11.3f} / {row['call_ms_max']:9.3f}  {row['x_none_per_round']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "kineto": args.kineto, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
