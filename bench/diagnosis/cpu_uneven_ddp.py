"""A small DDP job on CPU (gloo) where one rank's sequences are longer: the straggler of issue 28
item 5, small enough for a 2-core machine. No profiling code, like a user's script.

    aiprof run --skip 3 --iterations 3 --what python,shapes --out OUT --capture-id uneven \\
        -- torchrun --standalone --nproc-per-node 2 bench/diagnosis/cpu_uneven_ddp.py --long-rank 1
    (the same with --long-rank -1: every rank gets the same length, the control)
    torchrun --standalone --nproc-per-node 2 bench/diagnosis/cpu_uneven_ddp.py --long-rank 1 --steps 15
    (unprofiled: each rank prints its ms per step over the steps after --warm)

Each rank embeds a batch of token ids of shape [batch, seq] and runs a small transformer-style
block; rank ``--long-rank`` gets ``2 * seq`` tokens per sequence, the others
``seq``. DDP all-reduces the gradients (same sizes on every rank: the model is the same), so the
rank with the longer sequences arrives last at every all-reduce and the others wait for it.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# the same GPT-2-style model as the GPU pairs (this script's folder is on sys.path)
from v3_job import GPT

VOCAB = 2048  # smaller than the GPU pairs' model: two ranks share 2 cores
D = 128
LAYERS = 1
HEADS = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=int, default=3, help="steps before the timed ones (aiprof run --skip 3 records after them)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--long-rank", type=int, default=1, help="the rank whose sequences are 2x longer; -1: none")
    a = ap.parse_args()
    torch.set_num_threads(1)  # one core per rank: the ranks do not compete inside a rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT(vocab=VOCAB, d=D, layers=LAYERS, heads=HEADS, seq=2 * a.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_seq = 2 * a.seq if rank == a.long_rank else a.seq
    g = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for i in range(a.steps):
        if i == a.warm:
            t0 = time.perf_counter()
        x = torch.randint(0, VOCAB, (a.batch, n_seq), generator=g)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    timed = a.steps - a.warm if a.steps > a.warm else a.steps
    ms = (time.perf_counter() - t0) * 1e3 / timed
    dist.barrier()  # ranks leave together
    print(f"rank {rank} seq {n_seq}: {ms:.1f} ms per step over {timed} steps after {a.steps - timed}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
