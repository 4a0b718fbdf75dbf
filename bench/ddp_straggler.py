"""4-rank DDP GPT-2 (small config) where one rank does extra GPU work every step: a straggler.

    torchrun --nproc_per_node 4 bench/ddp_straggler.py --slow-rank 2 --out DIR

Profiles 3 steps with torch.profiler (CPU+CUDA only, light) and writes
DIR/ddp4_slow<R>_rank<r>.json.gz per rank. The slow rank runs --extra 4096x4096 bf16 matmuls
(in a function named `extra_work`) before each forward pass.
"""
import argparse
import gzip
import os
import shutil

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel


def extra_work(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a = a @ a
        a = a / a.norm()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow-rank", type=int, default=2)
    ap.add_argument("--extra", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=512, vocab_size=8192)
    model = DDP(GPT2LMHeadModel(cfg).to(dev), device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (8, 512), device=dev)
    m = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        if rank == a.slow_rank:
            extra_work(m, a.extra)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sched = torch.profiler.schedule(wait=0, warmup=2, active=3, repeat=1)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for _ in range(3):  # warm up kernels and NCCL outside the profiler
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts, schedule=sched) as prof:
        for _ in range(5):
            step()
            prof.step()
    torch.cuda.synchronize()
    os.makedirs(a.out, exist_ok=True)
    raw = os.path.join(a.out, f"ddp4_slow{a.slow_rank}_rank{rank}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(raw)
    print(f"rank {rank}/{world}: {raw}.gz {os.path.getsize(raw + '.gz')} bytes", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
