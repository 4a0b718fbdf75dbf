"""A small MLP trained on the CPU with autograd's anomaly detection left on: ANOMALY_MODE's pair,
small enough for a 2-core machine. No profiling code, like a user's script.

    aiprof run --skip 20 --iterations 3 --what python --out OUT --capture-id fault \\
        -- python bench/diagnosis/cpu_anomaly.py --anomaly --seconds 6
    (the same without --anomaly: the fix)
    python bench/diagnosis/cpu_anomaly.py --anomaly --steps 60      (unprofiled: ms per step)

``torch.autograd.set_detect_anomaly(True)``: every forward op records its Python stack and every
backward output is checked for NaN (isnan(...)._is_any_true().item()).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

WIDTH = 256
LAYERS = 6
BATCH = 64
#: Steps before the unprofiled measurement (allocator, first-call costs).
WARM = 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anomaly", action="store_true", help="the fault: anomaly detection on")
    ap.add_argument("--seconds", type=float, default=0.0, help="train this long (under aiprof run)")
    ap.add_argument("--steps", type=int, default=0, help="train this many steps and print ms per step after WARM")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)
    if args.anomaly:
        torch.autograd.set_detect_anomaly(True)
    t_end = time.time() + args.seconds
    step, t0 = 0, 0.0
    while (args.steps and step < args.steps) or (not args.steps and time.time() < t_end):
        if step == WARM:
            t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
    if args.steps > WARM:
        print(f"{(time.perf_counter() - t0) * 1e3 / (args.steps - WARM):.3f} ms per step", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
