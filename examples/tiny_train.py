"""A tiny CPU PyTorch training loop: the embedded default workload for `make demo` and the tests.

An MLP on random data with AdamW. One step (``--slow-step``) sleeps inside ``get_batch`` to
imitate a slow input pipeline, so the analysis has a known fault to find.

    python examples/tiny_train.py --steps 20 --slow-step 7
    python examples/tiny_train.py --profile out/trace.json.gz   # raw torch.profiler capture
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def get_batch(step: int, batch: int, width: int, slow_step: int, slow_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one batch; sleeps on ``slow_step`` like a stalled data loader."""
    x = torch.randn(batch, width)
    y = torch.randn(batch, 1)
    if step == slow_step:
        time.sleep(slow_s)
    return x, y


def build(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Build the model and its optimizer."""
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.GELU(), nn.Linear(width, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One forward/backward/optimizer step; returns the loss."""
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps to run (0 = forever)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--slow-step", type=int, default=-1, help="step whose get_batch sleeps")
    ap.add_argument("--slow-ms", type=float, default=60.0, help="how long that sleep lasts")
    ap.add_argument("--profile", default="", help="write a raw torch.profiler trace of steps 2.. here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model, opt = build(args.width)

    prof = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile, schedule

        active = max(1, args.steps - 2)
        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=active),
                       record_shapes=True, with_stack=True, profile_memory=True, with_flops=True,
                       on_trace_ready=lambda p: p.export_chrome_trace(args.profile))
        prof.start()
    step = 0
    while args.steps == 0 or step < args.steps:
        x, y = get_batch(step, args.batch, args.width, args.slow_step, args.slow_ms / 1e3)
        train_step(model, opt, x, y)
        if prof is not None:
            prof.step()
        step += 1
    if prof is not None:
        prof.stop()


if __name__ == "__main__":
    main()
