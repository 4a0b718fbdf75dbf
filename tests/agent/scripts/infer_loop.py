"""A CPU inference loop with no optimizer: target for --entry and time-based (duration) captures.

    python infer_loop.py --calls 20        # 20 calls of serve_step, then exit
    python infer_loop.py --seconds 3       # call serve_step for 3 s
"""
import argparse
import time

import torch


def serve_step(model: torch.nn.Module, x: torch.Tensor) -> float:
    """One 'request': a forward pass."""
    with torch.no_grad():
        return float(model(x).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=0.0)
    ap.add_argument("--sleep-ms", type=float, default=2.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16))
    x = torch.randn(32, 128)
    t_end = time.monotonic() + args.seconds
    n = 0
    while (args.calls and n < args.calls) or (args.seconds and time.monotonic() < t_end) or (not args.calls and not args.seconds):
        serve_step(model, x)
        time.sleep(args.sleep_ms / 1000)
        n += 1
    print("calls", n, flush=True)


if __name__ == "__main__":
    main()
