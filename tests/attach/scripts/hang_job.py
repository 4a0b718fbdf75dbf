"""A distributed job in which one rank blocks: for `aiprof hang` tests and the GPU demo.

Every rank runs steps of compute + all_reduce; at step --block-at, rank --block-rank calls
load_batch(), which never returns (a stuck data source), so the other ranks wait in all_reduce.
Each rank writes <ready-dir>/rank<R> once it has reached the step where the hang starts.
With --ddp the step is a DDP forward/backward instead: its all-reduce is issued by DDP's C++
reducer, which no Python wrapper sees (only torch's flight recorder does).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python hang_job.py --backend gloo ...
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist


def load_batch(rank: int, block: bool) -> torch.Tensor:
    while block:  # a data source that never answers
        time.sleep(0.05)
    return torch.randn(64, 64)


def train_step(x: torch.Tensor, dev: str) -> torch.Tensor:
    y = (x @ x.T).to(dev)
    dist.all_reduce(y)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--block-rank", type=int, default=1)
    ap.add_argument("--block-at", type=int, default=3)
    ap.add_argument("--ready-dir", required=True)
    ap.add_argument("--ddp", action="store_true", help="train a DDP Linear model instead of a bare all_reduce")
    a = ap.parse_args()
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    dev = "cpu"
    if a.backend == "nccl":
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(dev)
    model = None
    if a.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(64, 64).to(dev), device_ids=None if dev == "cpu" else [torch.device(dev)])
    for step in range(1_000_000):
        if step == a.block_at:
            open(os.path.join(a.ready_dir, f"rank{rank}"), "w").close()
        x = load_batch(rank, rank == a.block_rank and step >= a.block_at)
        if model is not None:
            y = model(x.to(dev)).square().mean()
            y.backward()  # DDP's reducer all-reduces the gradient bucket here (C++)
        else:
            y = train_step(x, dev)
        if dev != "cpu":
            y.sum().item()


if __name__ == "__main__":
    main()
