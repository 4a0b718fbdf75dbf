"""A CPU training loop that slows down mid-run, then stalls once in I/O and once in a checkpoint.

Steps take about --fast-ms; steps FAST..FAST+SLOW-1 each sleep --slow-ms more (a
"slower data source"). With --gap-s, after the slow steps the loop stalls in `stuck_read()` for
that long, and three steps later (--ckpt-s) in `save_checkpoint()`.
"""
import argparse
import time

import torch


def stuck_read(s: float) -> None:
    time.sleep(s)


def save_checkpoint(s: float) -> None:
    time.sleep(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", type=int, default=30)
    ap.add_argument("--slow", type=int, default=25)
    ap.add_argument("--fast-ms", type=float, default=8.0)
    ap.add_argument("--slow-ms", type=float, default=12.0)
    ap.add_argument("--gap-s", type=float, default=0.0)
    ap.add_argument("--ckpt-s", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    for step in range(a.fast + a.slow + 6):
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        extra = a.slow_ms if a.fast <= step < a.fast + a.slow else 0.0
        left = (a.fast_ms + extra) / 1e3 - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        if step == a.fast + a.slow - 1 and a.gap_s:
            stuck_read(a.gap_s)
        if step == a.fast + a.slow + 2 and a.ckpt_s:
            save_checkpoint(a.ckpt_s)
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()
