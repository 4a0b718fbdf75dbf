"""The loop every CPU pair job shares: its options (--fault-style flag, --seconds under
``aiprof run``, --steps for the unprofiled ms per step) and its training loop, with no
profiling code, like a user's script."""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

#: Steps before the unprofiled measurement (allocator, first-call costs).
WARM = 10


def options(doc: str, flag: str, flag_help: str) -> argparse.ArgumentParser:
    """The shared options; a job adds its own before parsing."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(flag, action="store_true", help=f"the fault: {flag_help}")
    ap.add_argument("--seconds", type=float, default=0.0, help="train this long (under aiprof run)")
    ap.add_argument("--steps", type=int, default=0, help="train this many steps and print ms per step after WARM")
    return ap


def train(step: Callable[[], object], args: argparse.Namespace) -> int:
    """Run ``step`` for --steps steps (printing ms per step after WARM) or --seconds seconds."""
    torch.set_num_threads(1)
    t_end = time.time() + args.seconds
    n, t0 = 0, 0.0
    while (args.steps and n < args.steps) or (not args.steps and time.time() < t_end):
        if n == WARM:
            t0 = time.perf_counter()
        step()
        n += 1
    if args.steps > WARM:
        print(f"{(time.perf_counter() - t0) * 1e3 / (args.steps - WARM):.3f} ms per step", flush=True)
    return 0
