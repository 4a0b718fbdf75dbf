"""GPT-2 small DDP training, no profiler code: the `aiprof run` target on 2 GPUs.

    aiprof run --skip 10 --iterations 3 -- torchrun --nproc-per-node 2 bench/ddp_train.py

Copied from the probes' ddp_train.py with its own torch.profiler block removed. Rank
SLOW_RANK (default 1; -1 = none) does extra GPU work each step, so it is the straggler.
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
torch.manual_seed(0)
SLOW_RANK = int(os.environ.get("SLOW_RANK", "1"))
STEPS = int(os.environ.get("STEPS", "30"))
cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12)
model = DDP(GPT2LMHeadModel(cfg).cuda(), device_ids=[rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
B, T = 8, 1024
junk = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)


def step():
    x = torch.randint(0, 50257, (B, T)).cuda()
    if rank == SLOW_RANK:
        for _ in range(60):
            junk @ junk  # extra work: makes this rank the straggler
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


t0 = time.perf_counter()
for i in range(STEPS):
    step()
torch.cuda.synchronize()
print("rank", rank, "steps", STEPS, "ms/step", round((time.perf_counter() - t0) * 1e3 / STEPS, 2), flush=True)
dist.destroy_process_group()
