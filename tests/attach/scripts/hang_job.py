"""A distributed job in which one rank blocks: for `aiprof hang` tests and the GPU demo.

Every rank runs steps of compute + all_reduce; at step --block-at, rank --block-rank calls
load_batch(), which never returns (a stuck data source), so the other ranks wait in all_reduce.
Each rank writes <ready-dir>/rank<R> once it has reached the step where the hang starts.

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
    a = ap.parse_args()
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    dev = "cpu"
    if a.backend == "nccl":
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(dev)
    for step in range(1_000_000):
        if step == a.block_at:
            open(os.path.join(a.ready_dir, f"rank{rank}"), "w").close()
        x = load_batch(rank, rank == a.block_rank and step >= a.block_at)
        y = train_step(x, dev)
        if dev != "cpu":
            y.sum().item()


if __name__ == "__main__":
    main()
