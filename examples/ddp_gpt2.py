"""GPT-2 (124M, random weights) trained with DistributedDataParallel over NCCL, one process per GPU.

Run under torchrun for several GPUs, or alone for a 1-rank NCCL group (DDP still all-reduces its
gradient buckets through ncclAllReduce). Each step's time (after a CUDA synchronize) is appended
to ``--step-times`` as ``step unix_ns ms`` (``{rank}`` in the path: one file per rank); the DDP bucket sizes are written once to ``--buckets``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


#: Steps between the ranks' agreement on stopping (one 4-byte all-reduce each time).
STOP_CHECK_EVERY = 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="train this long")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    # not --log: under torchrun an abbreviation of its own --log-dir/--logs-specs is refused
    ap.add_argument("--step-times", default="steps.log", help="per-step times; {rank} in the name is the rank")
    ap.add_argument("--buckets", default="buckets.json")
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers)).cuda()
    ddp = DDP(model, device_ids=[local], bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
    t_end = time.time() + args.seconds
    step = 0
    stop = torch.zeros(1, device="cuda")
    with open(args.step_times.format(rank=rank), "w") as log:
        while not stop.item():
            t0 = time.perf_counter()
            x = torch.randint(0, 50257, (args.batch, args.seq), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            log.write(f"{step} {time.time_ns()} {(time.perf_counter() - t0) * 1e3:.3f}\n")
            log.flush()
            if step == 2 and rank == 0:
                data = ddp._get_ddp_logging_data()
                with open(args.buckets, "w") as f:
                    json.dump({k: data.get(k) for k in ("bucket_sizes", "rebuilt_bucket_sizes", "world_size",
                                                        "nccl_version", "backend_name")}, f)
            step += 1
            if step % STOP_CHECK_EVERY == 0:
                # the ranks agree on when to stop: a rank that ran one step more than the others
                # would wait in its all-reduce for ever (each rank's own clock decided before)
                stop.fill_(float(time.time() >= t_end))
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    print(f"rank {rank}: {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
