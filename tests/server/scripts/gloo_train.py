"""A tiny DDP job on CPU (gloo) for the service tests: no profiling code, like a user's script.

Trains until --seconds have passed or the file --stop-file exists (whichever first), so the
test decides when it ends. Each step does a little compute plus the gradient all-reduce.

    torchrun --standalone --nproc-per-node 2 gloo_train.py --seconds 60 --stop-file /tmp/stop
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--stop-file", default=None)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    t_end = time.monotonic() + a.seconds
    step = 0
    while True:
        if step % 10 == 0:  # all ranks agree on stopping (each alone could stop a step apart)
            stop = time.monotonic() > t_end or bool(a.stop_file and os.path.exists(a.stop_file))
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
        x = torch.randn(64, 256)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(a.step_sleep)  # stands for data loading
        step += 1
    # ranks leave together: one more collective so no rank exits while another still steps
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {os.environ.get('RANK')} done after {step} steps", flush=True)


if __name__ == "__main__":
    main()
