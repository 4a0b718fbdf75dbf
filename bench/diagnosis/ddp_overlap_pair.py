"""Validation pair for EXPOSED_BUCKET_COMM: DDP with one gradient bucket per step vs the default.

    torchrun --nproc-per-node 2 bench/diagnosis/ddp_overlap_pair.py            # 2 GPUs, NCCL; writes $OUT
    torchrun --nproc-per-node 2 bench/diagnosis/ddp_overlap_pair.py --cpu      # smoke run: gloo, CPU, tiny

The same deep MLP (bf16 autocast, fp32 parameters, fused AdamW) is wrapped twice in DDP:

* **fault**: ``bucket_cap_mb`` larger than all the gradients: every gradient goes into one bucket
  (plus DDP's small first bucket), all-reduced only once the whole backward has finished, so
  nothing of it overlaps compute;
* **fix**: DDP's default 25 MB buckets, launched while the backward still runs.

As in ``gpu_pairs.py``: warm-up, then ROUNDS rounds of fault / fix alternately, each timing STEPS
steps between two device syncs (unprofiled); the median round is each variant's step time per
rank. Then one profiled capture per variant and rank (torch.profiler, CPU+CUDA activities,
shapes, Python stacks; 3 active steps). Rank 0 writes ``$OUT/pairs.json`` in the format
``bench/diagnosis/validate.py`` reads, beside the traces ``ddp_overlap_{fault,fix}_rank{R}.json.gz``:

    python bench/diagnosis/validate.py $OUT

Sizes: ``--width`` x ``--depth`` linear layers (default 2048 x 24: ~100 M parameters, ~400 MB of
fp32 gradients) on ``--tokens`` rows (default 4096); on two NVLink H200s the all-reduce should be a
fifth to a third of the step: the script prints the fault/fix times and the measured share.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

NAME = "ddp_overlap"
EXPECT = "EXPOSED_BUCKET_COMM"
FIX_BUCKET_MB = 25  # DDP's default bucket_cap_mb
ACTIVE = 3  # profiled steps per capture


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="smoke run on CPU with gloo and tiny sizes")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warm", type=int, default=None)
    p.add_argument("--fix-bucket-mb", type=float, default=None,
                   help=f"the fix's bucket_cap_mb (default {FIX_BUCKET_MB}, DDP's; --cpu: 0.5, for its tiny model)")
    a = p.parse_args(argv)
    # (CPU smoke run, GPU) defaults
    defaults = {"width": (64, 2048), "depth": (4, 24), "tokens": (32, 4096), "rounds": (2, 5), "steps": (3, 20),
                "warm": (2, 5), "fix_bucket_mb": (0.5, FIX_BUCKET_MB)}
    for k, (cpu, gpu) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, cpu if a.cpu else gpu)
    for k in ("width", "depth", "tokens", "rounds", "steps", "warm", "fix_bucket_mb"):
        if getattr(a, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive")
    return a


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class Job:
    """One DDP-wrapped model, its optimizer and a fixed batch; ``step`` is one training step."""

    def __init__(self, args, dev: torch.device, bucket_mb: float) -> None:
        self.dev = dev
        model = mlp(args.width, args.depth).to(dev)
        self.grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ids = [dev.index] if dev.type == "cuda" else None
        self.model = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb)
        fused = {"fused": True} if dev.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, **fused)
        g = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
        self.x = torch.randn(args.tokens, args.width, generator=g).to(dev)

    def step(self, i: int) -> None:
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.dev.type == "cuda" else contextlib.nullcontext()
        with ctx:
            loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_rounds(jobs: dict[str, Job], args, dev: torch.device) -> dict[str, list[float]]:
    """Per-step wall time (ms) of each variant over alternating rounds, unprofiled."""
    for job in jobs.values():
        for i in range(args.warm):
            job.step(i)
    sync(dev)
    res: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(args.rounds):
        for name, job in jobs.items():
            sync(dev)
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                job.step(i)
            sync(dev)
            res[name].append((time.perf_counter() - t0) * 1e3 / args.steps)
    return res


def capture(job: Job, path: str, dev: torch.device) -> None:
    """Profile ACTIVE steps (after one wait and one warm-up step) into a gzipped Chrome trace."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    raw = tempfile.mktemp(suffix=".json", dir=os.path.dirname(path))
    prof = profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=ACTIVE), record_shapes=True,
                   with_stack=True, on_trace_ready=lambda p: p.export_chrome_trace(raw))
    dist.barrier()
    with prof:
        for i in range(2 + ACTIVE):
            job.step(1000 + i)
            prof.step()
    sync(dev)
    with open(raw, "rb") as f, gzip.open(path, "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)
    os.unlink(raw)


def median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def main(argv: list[str]) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 bench/diagnosis/ddp_overlap_pair.py", file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("ddp_overlap_pair.py needs CUDA GPUs (or --cpu for a smoke run)", file=sys.stderr)
        return 2
    out = os.environ.get("OUT") or os.path.join(os.getcwd(), "overlap_out")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(out, exist_ok=True)
    try:
        t0 = time.time()
        probe = mlp(args.width, args.depth)
        grad_mb = sum(p.numel() * p.element_size() for p in probe.parameters()) / 2**20
        del probe
        fault_mb = float(math.ceil(grad_mb) + 1)  # every gradient fits one bucket: nothing overlaps
        jobs = {"fault": Job(args, dev, fault_mb), "fix": Job(args, dev, args.fix_bucket_mb)}
        rounds = time_rounds(jobs, args, dev)
        traces = {}
        for name, job in jobs.items():
            fn = f"{NAME}_{name}_rank{rank}.json.gz"
            capture(job, os.path.join(out, fn), dev)
            traces[name] = fn
        mine = {"rounds_ms": rounds, "fault": median(rounds["fault"]), "fix": median(rounds["fix"]), "traces": traces}
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            per_rank = {str(r): {"fault": e["fault"], "fix": e["fix"]} for r, e in enumerate(every)}
            # the job's step is its slowest rank's
            f = max(e["fault"] for e in every)
            x = max(e["fix"] for e in every)
            pair = {"expect": EXPECT,
                    "fix": f"DDP(bucket_cap_mb={args.fix_bucket_mb:g}) instead of {fault_mb:.0f} (one bucket)",
                    "fault_ms": f, "fix_ms": x, "measured_share": (f - x) / f, "per_rank_ms": per_rank,
                    "timing": {"rounds_ms": {str(r): e["rounds_ms"] for r, e in enumerate(every)},
                               "steps_per_round": args.steps},
                    "config": {"width": args.width, "depth": args.depth, "tokens": args.tokens,
                               "grad_mb": grad_mb, "fault_bucket_mb": fault_mb, "fix_bucket_mb": args.fix_bucket_mb,
                               "world": world, "backend": dist.get_backend()},
                    "traces": {"fault": [e["traces"]["fault"] for e in every],
                               "fix": [e["traces"]["fix"] for e in every]},
                    "seconds": round(time.time() - t0, 1)}
            gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
            result = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu,
                      "sms": torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0,
                      "cpus": os.cpu_count(), "rounds": args.rounds, "steps": args.steps,
                      "source": "bench/diagnosis/ddp_overlap_pair.py", "pairs": {NAME: pair}}
            tmp = os.path.join(out, "pairs.json.tmp")
            with open(tmp, "w") as fh:
                json.dump(result, fh, indent=1)
            os.replace(tmp, os.path.join(out, "pairs.json"))
            print(f"{NAME}: fault {f:.2f} ms fix {x:.2f} ms saving {100 * pair['measured_share']:.1f}% "
                  f"({grad_mb:.0f} MB of gradients, {world} ranks, {pair['seconds']:.0f} s)", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
