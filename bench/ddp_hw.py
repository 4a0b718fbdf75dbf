"""Small DDP GPT-2 job with one slow rank, long enough steps for hardware samples: the target of
`aiprof run --what kernels,hw` in bench/hang_gpu.sh (no profiler code here).

    aiprof run --skip 5 --iterations 3 --what kernels,hw -- torchrun --nproc-per-node 4 bench/ddp_hw.py

The slow rank (SLOW_RANK, default 2) runs EXTRA 8192x8192 bf16 matmuls (~1.5 ms each on an H200)
before each step in `extra_work`; the others wait for it in DDP's all-reduce. STEPS steps.
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel


def extra_work(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.mm(a, a)


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    slow, extra, steps = int(os.environ.get("SLOW_RANK", "2")), int(os.environ.get("EXTRA", "300")), \
        int(os.environ.get("STEPS", "16"))
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=512, vocab_size=8192)
    model = DDP(GPT2LMHeadModel(cfg).to(dev), device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (8, 512), device=dev)
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(steps):
        if rank == slow:
            extra_work(m, extra)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"rank {rank}: {steps} steps, {(time.perf_counter() - t0) * 1e3 / steps:.1f} ms/step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
