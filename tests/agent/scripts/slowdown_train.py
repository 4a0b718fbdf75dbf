"""A CPU training loop that slows down mid-run, then stalls once in I/O and once in a checkpoint.

Steps take about --fast-ms; then at least --slow steps each sleep --slow-ms more (a "slower
data source"). With --gap-s, after the slow steps the loop stalls in `stuck_read()` for that
long, and three steps later (--ckpt-s) in `save_checkpoint()`; 6 steps end the run.

Under a loaded machine every step is stretched by scheduling delays, which can hide a fixed
extra sleep. Two options make the slowdown certain for tests of what follows it:
--slow-factor F makes each slow step last at least F times the median fast step this loop
measured, and --slow-until GLOB keeps the loop slow until a file matching GLOB exists (the
capture the slowdown should cause), at most --slow-max steps.
"""
import argparse
import glob
import statistics
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
    ap.add_argument("--slow-factor", type=float, default=0.0)
    ap.add_argument("--slow-until", default="")
    ap.add_argument("--slow-max", type=int, default=200)
    ap.add_argument("--gap-s", type=float, default=0.0)
    ap.add_argument("--ckpt-s", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # two intra-op threads on a busy 2-core box wait on each other: 150 ms steps
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    fast_s: list[float] = []
    step = 0
    slow_end = a.fast if a.slow <= 0 and not a.slow_until else None  # first step after the slow phase, once known
    while slow_end is None or step < slow_end + 6:
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        slow = step >= a.fast and (slow_end is None or step < slow_end)
        target = (a.fast_ms + (a.slow_ms if slow else 0.0)) / 1e3
        if slow and a.slow_factor and fast_s:
            target = max(target, a.slow_factor * statistics.median(fast_s))
        left = target - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        if not slow and slow_end is None:
            fast_s.append(time.perf_counter() - t0)
        if slow:
            done = step + 1 - a.fast >= a.slow and (not a.slow_until or glob.glob(a.slow_until))
            if done or step + 1 - a.fast >= a.slow_max:
                slow_end = step + 1
        if slow_end is not None and step == slow_end - 1 and a.gap_s:
            stuck_read(a.gap_s)
        if slow_end is not None and step == slow_end + 2 and a.ckpt_s:
            save_checkpoint(a.ckpt_s)
        print(f"step {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
