"""examples/tiny_train.py's model and step, for the agent's fault tests: every step prints its
time, and the test can tell where the job is and hold it there, without timing.

    --gate K:FILE             before step K, write FILE.waiting (the pid) and wait until FILE
                              exists (at most --gate-max-s); repeatable
    --graceful-sigterm        SIGTERM ends the loop after the current step (or gate); exit 0
    --own-profiler A:B        the job's own torch.profiler records steps A..B-1 into --own-trace;
                              each step runs inside record_function("job_step_<k>")
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from tiny_train import build, get_batch, train_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gate", action="append", default=[])
    ap.add_argument("--gate-max-s", type=float, default=120.0)
    ap.add_argument("--graceful-sigterm", action="store_true")
    ap.add_argument("--own-profiler", default="")
    ap.add_argument("--own-trace", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, opt = build(64)
    stop = []
    if a.graceful_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    own = None
    p0, p1 = (int(x) for x in a.own_profiler.split(":")) if a.own_profiler else (-1, -1)
    gates = {int(k): f for k, f in (g.split(":", 1) for g in a.gate)}
    for step in range(a.steps):
        if stop:
            print(f"stopped by SIGTERM before step {step}", flush=True)
            break
        if step in gates:
            # atomically (write, then rename): the test reads our pid as soon as the file exists
            tmp = Path(gates[step] + ".waiting.tmp")
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, gates[step] + ".waiting")
            deadline = time.monotonic() + a.gate_max_s
            while not os.path.exists(gates[step]) and time.monotonic() < deadline and not stop:
                time.sleep(0.02)
            if stop:
                print(f"stopped by SIGTERM before step {step}", flush=True)
                break
        if step == p0:
            from torch.profiler import ProfilerActivity, profile

            own = profile(activities=[ProfilerActivity.CPU])
            own.start()
        t0 = time.perf_counter()
        with record_function(f"job_step_{step}"):
            x, y = get_batch(step, 16, 64, -1, 0.0)
            train_step(model, opt, x, y)
        print(f"step {step} {(time.perf_counter() - t0) * 1e3:.3f} ms", flush=True)
        if step == p1 - 1 and own is not None:
            own.stop()
            own.export_chrome_trace(a.own_trace)
            own = None
    else:
        print(f"done {a.steps} steps", flush=True)


if __name__ == "__main__":
    main()
