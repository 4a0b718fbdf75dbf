"""A tiny CPU loop profiled by torch.profiler's tensorboard_trace_handler: ``REPEAT`` cycles of
one process into OUT (files named ``{host}_{pid}.{time_ns}.pt.trace.json.gz``). With a third
argument DIR, also one cycle each into DIR/rank0 and DIR/rank1 under one custom worker name."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


def cycles(out: str, repeat: int, worker: str | None = None) -> None:
    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=repeat),
                 on_trace_ready=tensorboard_trace_handler(out, worker_name=worker, use_gzip=True)) as p:
        for _ in range(3 * repeat):
            x = (x @ x).tanh()
            p.step()


if __name__ == "__main__":
    cycles(sys.argv[1], int(sys.argv[2]))
    if len(sys.argv) > 3:
        for r in (0, 1):
            cycles(f"{sys.argv[3]}/rank{r}", 1, worker="trainer")
