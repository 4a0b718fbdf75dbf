"""The diagnosis validation set: real GPU jobs, each as a pair (fault on / fix applied).

    python3 bench/diagnosis/gpu_pairs.py [NAME ...]      # on a GPU machine; writes $OUT

For every pair the same step function runs with the fault and with the fix:

1. **Unprofiled timing** (what the user would measure): warm-up, then ROUNDS rounds of
   fault / fix alternately, each round timing STEPS steps between two device syncs; the median
   round gives the step time of each variant.
2. **A profiled capture of each variant** (torch.profiler with CPU+CUDA activities, shapes and
   Python stacks: aiprof's ``--what kernels,python,shapes``), 3 active steps.

Then calibration jobs that price the profiler's own overhead per recorded event, CUDA graph
replay and host<->device copies: facts the what-if model needs that a trace cannot give.

Everything lands in $OUT: ``pairs.json`` (timings, environment, calibration) and the traces in
``traces-<k>.tar`` (gzipped Kineto JSON, split under 15 MB a file). ``bench/diagnosis/validate.py``
analyses them on any machine and prints predicted vs measured savings.
"""
from __future__ import annotations

import gzip
import json
import os
import queue
import random
import shutil
import socket
import sys
import tarfile
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

OUT = os.environ.get("OUT") or os.path.join(os.getcwd(), "pairs_out")
DEV = "cuda"
ROUNDS = 3
STEPS = 12
WARM = 4
TRACES = tempfile.mkdtemp(prefix="pairs-")


# ------------------------------------------------------------------------------ helpers
def sync() -> None:
    torch.cuda.synchronize()


def time_rounds(fault, fix, steps: int | None = None, warm: int = WARM, rounds: int | None = None) -> dict:
    """Median per-step wall time (ms) of each variant over alternating rounds."""
    steps = STEPS if steps is None else steps
    rounds = ROUNDS if rounds is None else rounds
    res = {"fault": [], "fix": []}
    it = {"fault": 0, "fix": 0}
    for name, fn in (("fault", fault), ("fix", fix)):
        for _ in range(warm):
            fn(it[name])
            it[name] += 1
    sync()
    for _ in range(rounds):
        for name, fn in (("fault", fault), ("fix", fix)):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn(it[name])
                it[name] += 1
            sync()
            res[name].append((time.perf_counter() - t0) * 1e3 / steps)
    out = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    out["rounds_ms"] = res
    out["steps_per_round"] = steps
    return out


def profiled(name: str, fn, start: int = 1000, with_stack: bool = True, active: int = 3, shapes: bool = True) -> str:
    """Profile ``active`` steps of ``fn`` (after one wait and one warm-up step); gzip the trace."""
    raw = os.path.join(TRACES, name + ".json")
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=1, warmup=1, active=active), record_shapes=shapes,
                   with_stack=with_stack, on_trace_ready=lambda p: p.export_chrome_trace(raw))
    with prof:
        for i in range(2 + active):
            fn(start + i)
            prof.step()
    sync()
    dst = raw + ".gz"
    with open(raw, "rb") as f, gzip.open(dst, "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)
    os.unlink(raw)
    return dst


def gpt2(n_layer=4, n_embd=512, n_head=8, vocab=8192, positions=1024, activation="gelu_new"):
    """transformers' GPT-2. Its default activation, "gelu_new", is the GELU written out in
    elementwise ops (NewGELUActivation): an UNFUSED_POINTWISE chain in every job built on it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=positions, vocab_size=vocab,
                     activation_function=activation)
    return GPT2LMHeadModel(cfg).to(DEV)


def base_job(fused: bool = True, activation: str = "gelu_pytorch_tanh", **opt_kw):
    """The base of the training pairs: a GPT-2 (6 layers, width 768) on 16 x 1024 tokens, bf16
    autocast, fused AdamW; on an H100 its GPU work outlasts the host's (GPU-bound). Its GELU is
    the fused one: transformers' default "gelu_new", written out, is a fault of its own (46 % of
    the step on an H100, the gelu_new pair), and each pair measures one fault."""
    model = gpt2(n_layer=6, n_embd=768, n_head=12, activation=activation)
    kw = opt_kw or ({"fused": True} if fused else {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    x = torch.randint(0, 8192, (16, 1024), device=DEV)
    return model, opt, x


def train_step(model, opt, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


# ------------------------------------------------------------------------------ pairs
def alloc_churn():
    """torch.cuda.empty_cache() every step: the caching allocator returns its blocks, so every
    step cudaFree's (device-synchronising) and cudaMalloc's its activations again."""
    def make(fault):
        model, opt, x = base_job()

        def step(i):
            train_step(model, opt, x)
            if fault:
                torch.cuda.empty_cache()
        return step
    return make, "ALLOCATOR_CHURN", "remove torch.cuda.empty_cache() from the step"


def new_shapes():
    """cudnn.benchmark=True with a new image size every step: cuDNN benchmarks every algorithm
    for every new shape. Fix: pad each batch up to one fixed size."""
    def make(fault):
        torch.backends.cudnn.benchmark = True
        torch.manual_seed(0)
        layers = []
        c = 3
        for w in (32, 64, 64, 128):
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
            c = w
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)).to(DEV)
        model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        rng = random.Random(1 if fault else 2)
        y = torch.randint(0, 10, (32,), device=DEV)

        def get_batch():
            h, w = rng.randrange(64, 193, 8), rng.randrange(64, 193, 8)
            x = torch.randn(32, 3, h, w, device=DEV)
            if not fault:  # the fix: pad to one bucket (192x192)
                x = nn.functional.pad(x, (0, 192 - w, 0, 192 - h))
            return x.contiguous(memory_format=torch.channels_last)

        def step(i):
            x = get_batch()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return make, "NEW_INPUT_SHAPES", "pad every batch to one size (192x192)"


def unfused_optimizer():
    """AdamW(foreach=False): a dozen small kernels per parameter tensor. Fix: fused=True."""
    def make(fault):
        model, opt, x = base_job(**({"foreach": False} if fault else {"fused": True}))
        return lambda i: train_step(model, opt, x)
    return make, "UNFUSED_OPTIMIZER", "AdamW(fused=True)"


def item_per_param():
    """Per-parameter gradient statistics logged with .item(): three host syncs per parameter
    tensor (norm, largest magnitude, mean: 228 a step on the base job's 76 tensors). Fix: the
    same statistics stacked on the device and copied once. The base job stays GPU-bound, so
    the syncs are the only change (one read per tensor on 16 x 1024 tokens was ~2 ms, inside
    +-3 ms of run-to-run noise; on 8 x 512 tokens the job was launch-bound: two causes at once)."""
    def make(fault):
        model, opt, x = base_job()
        params = [p for p in model.parameters()]
        log = []

        def step(i):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, labels=x).loss
            loss.backward()
            if fault:
                stats = [(p.grad.norm().item(), p.grad.abs().max().item(), p.grad.mean().item()) for p in params]
            else:
                stats = torch.stack([torch.stack((p.grad.norm(), p.grad.abs().max(), p.grad.mean()))
                                     for p in params]).cpu().tolist()
            log.append(max(s[0] for s in stats))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return make, "HOST_SYNC", "stack the statistics on the GPU and copy once"


_WORDS = None


def _corpus():
    global _WORDS
    if _WORDS is None:
        r = random.Random(0)
        _WORDS = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randrange(2, 10)))
                  for _ in range(4000)]
    return _WORDS


def tokenize(seed: int, batch: int = 8, seq: int = 256) -> list[list[int]]:
    """A pure-Python byte-pair-style tokenizer over a synthetic text batch (CPU work, GIL held)."""
    words = _corpus()
    r = random.Random(seed)
    out = []
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < seq:
            w = words[r.randrange(len(words))]
            toks = list(w)
            merged = True
            while merged and len(toks) > 1:  # greedy pair merges, as a BPE would do
                merged = False
                best, bi = None, -1
                for j in range(len(toks) - 1):
                    pair = toks[j] + toks[j + 1]
                    score = (hash(pair) & 0xFFFF)
                    if score % 3 and (best is None or score < best):
                        best, bi = score, j
                if bi >= 0:
                    toks[bi:bi + 2] = [toks[bi] + toks[bi + 1]]
                    merged = True
            ids.extend((hash(t) & 0x1FFF) for t in toks)
        out.append(ids[:seq])
    return out


def host_tokenize():
    """A serving loop that tokenises each request batch in pure Python on the thread that
    drives the GPU. Fix: tokenise in a worker process, two batches ahead."""
    def make(fault):
        model = gpt2(n_layer=4, n_embd=1024, n_head=16).eval()
        pool = None if fault else ProcessPoolExecutor(1, mp_context=get_context("spawn"))
        pending: list = []

        def next_ids(i):
            if fault:
                return tokenize(i)
            while len(pending) < 3:
                pending.append(pool.submit(tokenize, i + len(pending)))
            return pending.pop(0).result()

        @torch.no_grad()
        def step(i):
            ids = torch.tensor(next_ids(i), device=DEV)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids).logits
            return logits[:, -1].argmax(-1).cpu()
        if pool is not None:
            pool.submit(tokenize, 0).result()  # start the worker before timing
        return step
    return make, "HOST_PREPROCESSING", "tokenise in a worker process, ahead of the GPU"


def launch_bound():
    """Eager inference of a deep, narrow MLP: hundreds of tiny kernels, the host launches
    slower than the GPU runs them. Fix: capture the forward once as a CUDA graph and replay it."""
    def make(fault):
        torch.manual_seed(0)
        blocks = []
        for _ in range(48):
            blocks += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
        model = nn.Sequential(*blocks).to(DEV).eval()
        x = torch.randn(32, 256, device=DEV)
        if fault:
            @torch.no_grad()
            def step(i):
                return model(x)
            return step
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            static_y = model(static_x)

        def step(i):
            g.replay()
            return static_y
        return step
    return make, "LAUNCH_BOUND", "CUDA graph of the forward"


def fp32_matmul():
    """fp32 matmuls with TF32 disabled run on the CUDA cores. Fix: allow TF32."""
    def make(fault):
        torch.manual_seed(0)
        a = torch.randn(4096, 4096, device=DEV)
        b = torch.randn(4096, 4096, device=DEV) / 64.0

        def step(i):
            torch.backends.cuda.matmul.allow_tf32 = not fault
            c = a
            for _ in range(6):
                c = torch.relu(c @ b)
            torch.backends.cuda.matmul.allow_tf32 = False
            return c
        return step
    return make, "MATMUL_OFF_TENSOR_CORES", "torch.backends.cuda.matmul.allow_tf32 = True"


def anomaly_mode():
    """autograd's anomaly detection left on: every backward output checked for NaN with a host
    read (a sync per output on the GPU) and every forward op's Python stack recorded. Fix: off."""
    def make(fault):
        model, opt, x = base_job()

        def step(i):
            with torch.autograd.set_detect_anomaly(fault):
                return train_step(model, opt, x)
        return step
    return make, "ANOMALY_MODE", "torch.autograd.set_detect_anomaly(False)"


def zero_grad():
    """Gradients zeroed every step (zero_grad(set_to_none=False)): a memset per parameter group
    and, in backward, an add into each zeroed gradient. Fix: set_to_none=True. Wide embeddings and
    a short sequence keep the gradients' memory passes a visible share of the step."""
    def make(fault):
        model = gpt2(n_layer=6, n_embd=1024, n_head=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, 8192, (4, 128), device=DEV)

        def step(i):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=not fault)
            return loss
        return step
    return make, "ZEROED_GRADS", "optimizer.zero_grad(set_to_none=True)"


def pageable_copy():
    """A 256 MiB pageable host tensor copied to the GPU every step (staged, blocking).
    Fix: pin it once and copy with non_blocking=True."""
    def make(fault):
        model, opt, x = base_job()
        big = torch.randn(64 * 1024 * 1024)
        if not fault:
            big = big.pin_memory()

        def step(i):
            extra = big.to(DEV, non_blocking=not fault)
            train_step(model, opt, x)
            return extra
        return step
    return make, "PAGEABLE_COPY", "pin_memory() once, copy with non_blocking=True"


class _SlowDataset(torch.utils.data.Dataset):
    """Samples that take ~1 ms of pure-Python decoding each."""

    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        r = random.Random(i)
        acc = 0
        for _ in range(6000):  # stands for decoding/augmentation
            acc = (acc * 31 + r.randrange(1000)) & 0xFFFFFFF
        return torch.full((1024,), acc % 8192, dtype=torch.long)


def dataloader_starved():
    """DataLoader(num_workers=0) whose samples cost ~1 ms of CPU each: the training thread
    decodes 8 samples before every step. Fix: 4 worker processes, pinned, prefetching."""
    def make(fault):
        model, opt, _ = base_job()
        kw = {"num_workers": 0} if fault else {"num_workers": 6, "pin_memory": True, "persistent_workers": True,
                                                "prefetch_factor": 4, "multiprocessing_context": "spawn"}
        it = iter(torch.utils.data.DataLoader(_SlowDataset(), batch_size=16, **kw))

        def step(i):
            x = next(it).to(DEV, non_blocking=True)
            train_step(model, opt, x)
        return step
    return make, "DATALOADER_STARVED", "DataLoader(num_workers=6, pin_memory=True)"


def underfilled(heads: int = 64, rows: int = 8, keys: int = 262144, dim: int = 32):
    """Attention of a few query rows over a long context, computed head by head in a Python loop.

    Each head's softmax runs one thread block per query row: 8 blocks on the H100's 132 SMs, each
    streaming a 512 KB row (tens of µs a kernel, so the GPU, not the host's ~6 launches per head,
    sets the pace), 64 times a step, back to back: the GPU busy but mostly idle. The two matmuls
    per head read K and V once whichever way they run (memory-bound; D=32 keeps them the smaller
    part). Fix: the same math batched over the heads (one bmm, one softmax over all 512 rows, one
    bmm).
    """
    def make(fault):
        torch.manual_seed(0)
        q = torch.randn(heads, rows, dim, device=DEV, dtype=torch.bfloat16) / dim ** 0.5
        k = torch.randn(heads, keys, dim, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(heads, keys, dim, device=DEV, dtype=torch.bfloat16)
        kt = k.transpose(1, 2)  # [heads, dim, keys], a view

        if fault:
            def step(i):
                out = []
                for h in range(heads):
                    p = torch.softmax(q[h] @ kt[h], dim=-1)
                    out.append(p @ v[h])
                return out
            return step

        def step(i):
            return torch.bmm(torch.softmax(torch.bmm(q, kt), dim=-1), v)
        return step
    return make, "SM_ARRAY_IDLE", "batch the heads: one bmm, one softmax over all rows, one bmm"


def healthy_gpt2():
    def make(fault):
        model, opt, x = base_job()
        return lambda i: train_step(model, opt, x)
    return make, None, "healthy: bf16 autocast, fused AdamW, data on the GPU"


def graphed_gpt2():
    """The healthy GPT-2 job (healthy_gpt2) against the same job with its forward and backward
    replayed from CUDA graphs (torch.cuda.make_graphed_callables of a module computing the loss;
    autocast without its cache, as graph capture requires; the fused optimizer stays eager).
    Meant as LAUNCH_BOUND's remedy on this job; measured 15 % slower than eager on an H100
    (27.06 against 23.51 ms: the uncached casts, the backward on side streams), so it prices
    nothing of LAUNCH_BOUND and is not in validate.py. Its capture is the replay's test of CUDA
    graphs on several streams (tests/diagnosis/test_graph_order.py)."""
    class Loss(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                return self.model(x, labels=x).loss

    def make(fault):
        model, opt, x = base_job()
        if fault:
            return lambda i: train_step(model, opt, x)
        loss_fn = torch.cuda.make_graphed_callables(Loss(model), (x,), num_warmup_iters=3)

        def step(i):
            loss_fn(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return make, "LAUNCH_BOUND", "the forward and backward replayed from CUDA graphs (make_graphed_callables)"


def gelu_new():
    """transformers' GPT-2 with its default "gelu_new" activation, a GELU written out in eight
    elementwise ops (the healthy_gpt2 job). Fix: "gelu_pytorch_tanh", the same function as one
    fused kernel (F.gelu(approximate="tanh"))."""
    def make(fault):
        model, opt, x = base_job(activation="gelu_new" if fault else "gelu_pytorch_tanh")  # fix = healthy_gpt2
        return lambda i: train_step(model, opt, x)
    return make, "UNFUSED_POINTWISE", 'activation_function="gelu_pytorch_tanh"'


def compile_gpt2():
    """The healthy GPT-2 job (healthy_gpt2, eager) against the same model under torch.compile
    (default mode; compiled in the warm-up steps): what the fusion UNCOMPILED_KERNEL_RUNS prices
    saves on the base of the training pairs, a model it was not fitted on."""
    def make(fault):
        model, opt, x = base_job()
        if not fault:
            model = torch.compile(model)
        return lambda i: train_step(model, opt, x)
    return make, "UNCOMPILED_KERNEL_RUNS", "torch.compile(model)"


def healthy_compiled():
    def make(fault):
        torch.manual_seed(0)
        blocks = []
        for _ in range(8):
            blocks += [nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024)]
        model = torch.compile(nn.Sequential(*blocks).to(DEV))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randn(128, 256, 1024, device=DEV)

        def step(i):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return make, None, "healthy: torch.compile'd MLP, bf16, fused AdamW"


PAIRS = {
    "alloc_churn": alloc_churn,
    "new_shapes": new_shapes,
    "unfused_optimizer": unfused_optimizer,
    "item_per_param": item_per_param,
    "host_tokenize": host_tokenize,
    "launch_bound": launch_bound,
    "fp32_matmul": fp32_matmul,
    "anomaly_mode": anomaly_mode,
    "zero_grad": zero_grad,
    "pageable_copy": pageable_copy,
    "dataloader_starved": dataloader_starved,
    "underfilled": underfilled,
    "healthy_gpt2": healthy_gpt2,
    "gelu_new": gelu_new,
    "graphed_gpt2": graphed_gpt2,
    "compile_gpt2": compile_gpt2,
    "healthy_compiled": healthy_compiled,
}
HEALTHY = ("healthy_gpt2", "healthy_compiled")


def run_pair(name: str) -> dict:
    make, expect, fix_text = PAIRS[name]()
    t0 = time.time()
    if name in HEALTHY:  # one job: time it, capture it
        fn = make(False)
        t = time_rounds(fn, fn)
        trace = profiled(f"{name}", fn)
        res = {"expect": None, "fix": fix_text, "step_ms": t["fault"], "timing": t,
               "traces": {"job": os.path.basename(trace)}}
    else:
        fault, fix = make(True), make(False)
        t = time_rounds(fault, fix)
        tf = profiled(f"{name}_fault", fault)
        tx = profiled(f"{name}_fix", fix)
        res = {"expect": expect, "fix": fix_text, "fault_ms": t["fault"], "fix_ms": t["fix"],
               "measured_share": (t["fault"] - t["fix"]) / t["fault"], "timing": t,
               "traces": {"fault": os.path.basename(tf), "fix": os.path.basename(tx)}}
    res["seconds"] = round(time.time() - t0, 1)
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------ 2 ranks, 1 GPU
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _ddp_rank(rank: int, port: int, q, traces: str, job: str) -> None:
    """DDP of two ranks: NCCL with a GPU each where the machine has two, else gloo with both
    ranks on cuda:0 (a one-GPU machine; the ranks then contend for it).

    job "straggler": rank 1's get_batch sleeps 30 ms in the fault.
    job "accum": 4 micro-batches per optimizer step; the fault all-reduces after every
    micro-batch, the fix skips it with model.no_sync() for the first three. On two GPUs the
    model is wider (GPT-2 4 x 1024: 60 M parameters, 240 MB of fp32 gradients) on 4 x 256 tokens
    per micro-batch: a small-batch fine-tune whose all-reduces are a real share of the step.
    """
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    global DEV
    two = torch.cuda.device_count() >= 2
    if two:
        DEV = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    # $PAIRS_DDP_BACKEND=gloo keeps gloo on two GPUs (the collectives then run on the host)
    backend = os.environ.get("PAIRS_DDP_BACKEND") or ("nccl" if two else "gloo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {"backend": dist.get_backend(), "device": torch.cuda.get_device_name(DEV), "gpus": 2 if two else 1}
    for variant in ("fault", "fix", "fault", "fix", "fault", "fix", "trace_fault", "trace_fix"):
        torch.manual_seed(0)
        if backend == "nccl" and job == "accum":
            net, x = gpt2(n_layer=4, n_embd=1024, n_head=16, vocab=8192), torch.randint(0, 8192, (4, 256), device=DEV)
        else:
            net, x = gpt2(n_layer=4, n_embd=256, n_head=4, vocab=1024), torch.randint(0, 1024, (8, 256), device=DEV)
        model = DDP(net, device_ids=[rank] if two and backend == "nccl" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fault = variant.endswith("fault")
        slow = job == "straggler" and rank == 1 and fault

        def get_batch():
            if slow:
                time.sleep(0.030)  # the injected fault: this rank's input is late every step
            return x

        def step(i):
            if job == "straggler":
                train_step(model, opt, get_batch())
                return
            for mb in range(4):
                quiet = model.no_sync() if (not fault and mb < 3) else contextlib.nullcontext()
                with quiet:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x, labels=x).loss / 4
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for i in range(WARM):
            step(i)
        sync()
        dist.barrier()
        if variant.startswith("trace"):
            tag = variant.split("_")[1]
            path = profiled(f"{job}2_{tag}_rank{rank}", step)
            shutil.move(path, os.path.join(traces, os.path.basename(path)))
        else:
            t0 = time.perf_counter()
            for i in range(STEPS):
                step(i)
            sync()
            out.setdefault(variant, []).append((time.perf_counter() - t0) * 1e3 / STEPS)
        dist.barrier()
    q.put((rank, out))
    dist.destroy_process_group()


def ddp2(job: str) -> dict:
    ctx = get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, port, q, TRACES, job)) for r in range(2)]
    for p in procs:
        p.start()
    res = {}
    deadline = time.time() + 300
    while len(res) < len(procs) and time.time() < deadline:
        try:
            r, out = q.get(timeout=5)
            res[r] = out
        except queue.Empty:
            if not all(p.is_alive() for p in procs) and q.empty():
                break  # a rank died: report what came back instead of hanging
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if len(res) < len(procs):
        raise RuntimeError(f"{job}: only ranks {sorted(res)} reported")
    env = {k: res[0].pop(k) for k in ("backend", "device", "gpus")}
    for o in res.values():
        for k in env:
            o.pop(k, None)
    med = {r: {k: sorted(v)[len(v) // 2] for k, v in o.items()} for r, o in res.items()}
    f, x = med[0]["fault"], med[0]["fix"]
    expect, fix = (("STRAGGLER", "rank 1 loads its input without the 30 ms stall") if job == "straggler" else
                   ("GRAD_ACCUM_ALLREDUCE", "model.no_sync() for the first 3 of 4 micro-batches"))
    return {"expect": expect, "fix": fix, "fault_ms": f, "fix_ms": x, "measured_share": (f - x) / f,
            "per_rank_ms": med, "ddp": env, "traces": {"fault": [f"{job}2_fault_rank0.json.gz", f"{job}2_fault_rank1.json.gz"],
                                           "fix": [f"{job}2_fix_rank0.json.gz", f"{job}2_fix_rank1.json.gz"]}}


# ------------------------------------------------------------------------------ calibration
def calibrate() -> dict:
    """Facts for the what-if model, from jobs separate from the pairs.

    Profiler cost per recorded event: four loops that each stress one kind of event (torch ops,
    Python function calls, builtin calls, CUDA runtime calls without an op), timed unprofiled and
    under the profiler (aiprof's kernels+python+shapes, and kernels only) in interleaved
    repetitions, after a throwaway profiling session; the traces give the events per step.
    Then CUDA-graph kernel spacing and copy bandwidths.
    """
    import math as _m

    cal = {"loops": {}}
    x = torch.zeros(1, device=DEV)
    lst = list(range(16))
    stream = torch.cuda.current_stream()

    def ops_step(i, n=400):
        for _ in range(n):
            x.add_(1.0)

    def leaf(v):
        return v + 1

    def pyfunc_step(i, n=4000):
        acc = 0
        for _ in range(n):
            acc = leaf(acc)
        x.add_(1.0)
        return acc

    def builtin_step(i, n=4000):
        acc = 0.0
        for k in range(n):
            acc += _m.sqrt(len(lst) + k)
        x.add_(1.0)
        return acc

    def runtime_step(i, n=400):
        for _ in range(n):
            stream.query()
        x.add_(1.0)

    text = [" ".join(f"Word{k % 97}, item{k % 13}." for k in range(j, j + 12)) for j in range(64)]

    def pyreal_step(i, n=300):
        counts: dict = {}
        for k in range(n):
            for w in text[k % len(text)].split():
                w = w.strip(".,").lower()
                counts[w] = counts.get(w, 0) + 1
        x.add_(1.0)
        return len(counts)

    loops = {"ops": ops_step, "pyfunc": pyfunc_step, "builtin": builtin_step, "runtime": runtime_step,
             "pyreal": pyreal_step}
    profiled("calib_warmup", ops_step, active=2)  # the first profiling session pays one-off setup

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        for i in range(10):
            fn(i)
        sync()
        return (time.perf_counter() - t0) * 1e3 / 10

    def timed_prof(fn, stack: bool) -> float:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=stack,
                     with_stack=stack):
            v = timed(fn)
        return v

    for name, fn in loops.items():
        for _ in range(10):
            fn(0)
        un, full, light = [], [], []
        for _ in range(5):
            un.append(timed(fn))
            full.append(timed_prof(fn, True))
            light.append(timed_prof(fn, False))
        cal["loops"][name] = {"unprofiled_ms": sorted(un)[2], "profiled_full_ms": sorted(full)[2],
                              "profiled_light_ms": sorted(light)[2],
                              "trace_full": os.path.basename(profiled(f"calib_{name}_full", fn, with_stack=True, active=3)),
                              "trace_light": os.path.basename(profiled(f"calib_{name}_light", fn, with_stack=False,
                                                                       active=3, shapes=False))}
    # CUDA graph: N tiny kernels replayed
    n = 2000
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops_step(0, 10)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        ops_step(0, n)
    for _ in range(3):
        g.replay()
    sync()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        g.replay()
    e1.record()
    sync()
    cal["graph_kernels"] = n
    cal["graph_replay_ms"] = e0.elapsed_time(e1) / 10
    cal["graph_trace"] = os.path.basename(profiled("calib_graph", lambda i: g.replay(), with_stack=False))
    # copies
    nbytes = 256 << 20
    host = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    for label, fn in (("h2d_pageable", lambda: dev.copy_(host)), ("h2d_pinned", lambda: dev.copy_(pinned, non_blocking=True)),
                      ("d2h_pinned", lambda: pinned.copy_(dev, non_blocking=True)), ("d2d", lambda: dev2.copy_(dev))):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        sec = (time.perf_counter() - t0) / 5
        cal[f"{label}_gbps"] = nbytes / sec / 1e9 * (2 if label == "d2d" else 1)
    return cal


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_pairs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(OUT, exist_ok=True)
    global ROUNDS, STEPS
    args = sys.argv[1:]
    if "--rounds" in args:
        ROUNDS = int(args[args.index("--rounds") + 1])
    if "--steps" in args:
        STEPS = int(args[args.index("--steps") + 1])
    only = [a for a in args if not a.startswith("-") and not a.isdigit()]
    result = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
              "sms": torch.cuda.get_device_properties(0).multi_processor_count, "cpus": os.cpu_count(),
              "rounds": ROUNDS, "steps": STEPS, "pairs": {}, "errors": {}}
    todo = only or ["calibration"] + list(PAIRS) + ["straggler2", "accum2"]
    for name in todo:
        t0 = time.time()
        try:
            if name in ("straggler2", "accum2"):
                result["pairs"][name] = ddp2(name[:-1] if name == "accum2" else "straggler")
            elif name == "calibration":
                result["calibration"] = calibrate()
            else:
                result["pairs"][name] = run_pair(name)
            p = result["pairs"].get(name, {})
            line = (f"fault {p['fault_ms']:.2f} ms fix {p['fix_ms']:.2f} ms saving {100 * p['measured_share']:.1f}%"
                    if "fault_ms" in p else (f"step {p['step_ms']:.2f} ms" if "step_ms" in p else ""))
            print(f"{name}: {line} ({time.time() - t0:.0f} s)", flush=True)
        except Exception as exc:
            result["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
        with open(os.path.join(OUT, "pairs.json"), "w") as f:
            json.dump(result, f, indent=1)
    # pack the traces, under 15 MB a tar
    files = sorted(os.listdir(TRACES))
    part, size, k = [], 0, 0
    for fn in files + [None]:
        sz = os.path.getsize(os.path.join(TRACES, fn)) if fn else 0
        if fn is None or (part and size + sz > 15_000_000):
            with tarfile.open(os.path.join(OUT, f"traces-{k}.tar"), "w") as tar:
                for p in part:
                    tar.add(os.path.join(TRACES, p), arcname=p)
            k += 1
            part, size = [], 0
        if fn:
            part.append(fn)
            size += sz
    for fn in files:
        print(f"  {fn}: {os.path.getsize(os.path.join(TRACES, fn)) / 1e6:.2f} MB")
    print(json.dumps(result.get("calibration", {}), indent=1))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
