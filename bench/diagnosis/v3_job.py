"""One training job of the v3 diagnosis pairs (issue 28): the same GPT-2-style step with one fault
switched on or off. Run plain to time it, or under `aiprof run` to capture it as a user would.

    python bench/diagnosis/v3_job.py --case gc --variant fault --steps 20 --times OUT.json
    torchrun --nproc-per-node 4 bench/diagnosis/v3_job.py --case ddp_uneven --variant fault ...

Cases (fault -> fix):
  healthy       no fault (the negative control)
  gc            gc.collect() every step with ~3 M live Python objects -> no per-step collect
  ckpt          torch.save(model + optimizer state) every step, on the training thread -> none
  print         print() of the loss, a GPU tensor, every step (a sync + formatting) -> none
  fileread      a 256 MiB file read (open().read()) every step -> read once, before the loop
  stall         one 80 ms host pause (time.sleep) in step STALL_STEP only -> none
  launch        the plain eager job (= healthy) -> the model compiled with
                torch.compile(mode="reduce-overhead") (CUDA graphs; compiled and recorded in the
                WARM steps, which the capture's --skip WARM lets pass): is LAUNCH_BOUND honest?
  ddp_uneven    4-rank DDP; rank 0's sequences are twice as long -> equal lengths
  ddp_healthy   4-rank DDP, no fault
  fsdp_healthy  4-rank FSDP2 (fully_shard per block), no fault

--times writes {"ms_per_step": ..., "steps": N, "window": [first, last)}: the wall time of the
steps [warm, warm + steps) between two device syncs (rank 0 for distributed cases).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from torch import nn

WARM = 10  # steps before the timed window; `aiprof run --skip 10` captures from the same step
STALL_STEP = WARM + 1  # inside both the timed window and a 3-iteration capture after --skip WARM
STALL_S = 0.080
FILE_BYTES = 256 << 20
LIVE_OBJECTS = 3_000_000


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 512, layers: int = 6, heads: int = 8, seq: int = 1024) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--variant", choices=("fault", "fix"), required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--times", default="")
    ap.add_argument("--batch", type=int, default=8,
                    help="sequences per rank (48 makes the step GPU-bound on an H100: the 4-rank pairs)")
    ap.add_argument("--cpu", action="store_true", help="a smoke test of the script on a machine without a GPU")
    a = ap.parse_args()
    fault = a.variant == "fault"
    dist_case = a.case.startswith(("ddp", "fsdp"))
    rank, local = 0, 0
    if dist_case:
        import torch.distributed as dist

        dist.init_process_group("nccl")
        rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    if a.cpu:
        dev = torch.device("cpu")
        torch.cuda.synchronize = lambda *_: None  # a smoke test: nothing to wait for
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    torch.manual_seed(0)
    seq, batch = 512, a.batch
    model = GPT(seq=2 * seq).to(dev)
    if a.case == "ddp_uneven" or a.case == "ddp_healthy":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local])
    elif a.case == "fsdp_healthy":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    graphs = a.case == "launch" and not fault
    if graphs:  # the optimizer stays eager, as in the fault; only the forward/backward is graphed
        model = torch.compile(model, mode="reduce-overhead")
    n_seq = 2 * seq if (a.case == "ddp_uneven" and fault and rank == 0) else seq
    x = torch.randint(0, 8192, (batch, n_seq), device=dev)
    heap = [[i] for i in range(LIVE_OBJECTS)] if a.case == "gc" else None
    path = f"/tmp/v3_{a.case}_{os.getpid()}.bin"
    if a.case == "fileread":
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * (FILE_BYTES >> 20))
        once = None if fault else open(path, "rb").read()
    ckpt = f"/tmp/v3_ckpt_{os.getpid()}.pt"

    def step(i: int) -> None:
        if graphs:  # a new iteration: the last step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if a.case == "fileread":
            data = open(path, "rb").read() if fault else once
            assert len(data) == FILE_BYTES
        if a.case == "stall" and fault and i == STALL_STEP:
            time.sleep(STALL_S)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.float().view(-1, 8192), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fault and a.case == "gc":
            gc.collect()
        if fault and a.case == "ckpt":
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
        if fault and a.case == "print":
            print(f"step {i} loss {loss}", flush=True)

    t_warm = time.perf_counter()
    for i in range(WARM):
        step(i)
    torch.cuda.synchronize()
    if graphs:  # the compile and graph recording must be done before the window (and the capture)
        from torch._dynamo.utils import counters

        print(f"launch fix: {WARM} warm-up steps took {time.perf_counter() - t_warm:.1f} s; "
              f"dynamo {dict(counters['stats'])}", flush=True)
    t0 = time.perf_counter()
    for i in range(WARM, WARM + a.steps):
        step(i)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / a.steps
    if graphs:  # unchanged from the line above: no recompile inside the window
        print(f"launch fix: after the window dynamo {dict(counters['stats'])}", flush=True)
    if a.times and rank == 0:
        with open(a.times, "w") as f:
            json.dump({"case": a.case, "variant": a.variant, "ms_per_step": ms, "steps": a.steps,
                       "window": [WARM, WARM + a.steps]}, f)
    for p in (path, ckpt):
        if os.path.exists(p):
            os.unlink(p)
    del heap
    if dist_case:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
