"""Capture one small Kineto trace per diagnosis scenario, each with a known injected behaviour.

    python3 bench/scenarios/capture.py            # writes $OUT (or ./scenarios_out) /<name>.json.gz

Needs torch with CUDA, transformers (for GPT-2; the model is built from a config with random
weights, so no internet) and one GPU. Every trace is gzipped and kept small (few steps, a small
GPT-2); the script prints each file's size and the ground truth, and writes it all to
``scenarios.json`` beside the traces. Copy the traces into tests/data/scenarios/.

| scenario | injected behaviour | the finding it should produce |
|---|---|---|
| generate_b1 | eager GPT-2 ``generate`` with batch 1 (tiny kernels, one token at a time) | GPU_IDLE_HOST_BOUND |
| slow_getitem | DataLoader (num_workers=0) whose ``__getitem__`` sleeps 4 ms per sample | DATA_LOADING |
| item_in_loop | ``.item()`` on a GPU tensor after every block of the forward pass | SYNC_STALL |
| sync_logging | ``loss.item()`` per micro-batch, then host-side logging before the next launch | SYNC_STALL |
| pageable_copy | a 256 MiB pageable host tensor copied to the GPU every step | MEMCPY_PAGEABLE |
| fp32_matmul | fp32 matmuls with TF32 disabled | LOW_TENSOR_CORE |
| healthy | bf16 autocast GPT-2 training, data already on the GPU | no ``high`` finding |
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

OUT = os.environ.get("OUT") or os.path.join(os.getcwd(), "scenarios_out")
MAX_BYTES = 1_500_000
DEV = "cuda"
WAIT, WARMUP, ACTIVE = 1, 1, 3  # profiled steps per scenario: ACTIVE


def _gpt2(n_layer: int = 4, n_embd: int = 512, n_head: int = 8, n_positions: int = 512):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=50257)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(DEV)


def _profiled(name: str, step_fn, steps: int = WAIT + WARMUP + ACTIVE, with_stack: bool = True) -> str:
    """Run ``step_fn(i)`` under torch.profiler (CPU+CUDA, shapes, stacks) and write <name>.json.gz."""
    tmp = tempfile.mkdtemp()
    raw = os.path.join(tmp, name + ".json")
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE),
                   record_shapes=True, with_stack=with_stack, profile_memory=False, with_flops=False,
                   on_trace_ready=lambda p: p.export_chrome_trace(raw))
    with prof:
        for i in range(steps):
            step_fn(i)
            prof.step()
    torch.cuda.synchronize()
    dst = os.path.join(OUT, name + ".json.gz")
    with open(raw, "rb") as f, gzip.open(dst, "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)
    shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _train_step(model, opt, x, y=None, autocast: bool = True):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, labels=x if y is None else y).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def generate_b1() -> str:
    model = _gpt2().eval()
    prompt = torch.randint(0, 50257, (1, 16), device=DEV)

    @torch.no_grad()
    def step(i):
        model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)

    step(0)
    return _profiled("generate_b1", step)


def slow_getitem() -> str:
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            time.sleep(0.004)  # the injected fault: slow decoding/augmentation per sample
            return torch.randint(0, 50257, (256,))

    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    it = iter(DataLoader(Slow(), batch_size=8, num_workers=0))

    def step(i):
        x = next(it).to(DEV)
        _train_step(model, opt, x)

    return _profiled("slow_getitem", step)


def item_in_loop() -> str:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (8, 256), device=DEV)
    norms = []

    def hook(_m, _inp, out):
        h = out[0] if isinstance(out, tuple) else out
        norms.append(h.float().norm().item())  # the injected fault: a host sync per block

    for blk in model.transformer.h:
        blk.register_forward_hook(hook)

    def step(i):
        loss = _train_step(model, opt, x)
        norms.append(loss.item())

    return _profiled("item_in_loop", step)


def sync_logging() -> str:
    """Per-micro-batch ``loss.item()`` followed by host-side metric logging (the common pattern):
    the sync drains the GPU queue, so the GPU idles for as long as the host logs."""
    import json
    import random

    model = _gpt2(n_layer=4, n_embd=1024, n_head=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (8, 512), device=DEV)
    rng = random.Random(0)
    log = []

    def step(i):
        for mb in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, labels=x).loss / 2
            loss.backward()
            value = loss.item()  # the injected fault: a sync, then host work before the next launch
            sample = sorted(rng.random() for _ in range(30_000))
            log.append(json.dumps({"step": i, "mb": mb, "loss": value, "p50": sample[len(sample) // 2]}))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _profiled("sync_logging", step)


def pageable_copy() -> str:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    big = torch.randn(64 * 1024 * 1024)  # 256 MiB, pageable (not pinned): the injected fault
    x = torch.randint(0, 50257, (8, 256), device=DEV)

    def step(i):
        extra = big.to(DEV)  # synchronous, staged copy
        _train_step(model, opt, x)
        del extra

    return _profiled("pageable_copy", step, with_stack=False)


def fp32_matmul() -> str:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    a = torch.randn(4096, 4096, device=DEV)
    b = torch.randn(4096, 4096, device=DEV)

    def step(i):
        c = a
        for _ in range(8):
            c = torch.mm(c, b) * 1e-3  # fp32 on CUDA cores: the injected fault
        torch.cuda.synchronize()

    out = _profiled("fp32_matmul", step)
    torch.backends.cuda.matmul.allow_tf32 = True
    return out


def healthy() -> str:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 50257, (16, 512), device=DEV)

    def step(i):
        _train_step(model, opt, x)

    return _profiled("healthy", step)


SCENARIOS = {
    "generate_b1": (generate_b1, "GPU_IDLE_HOST_BOUND"),
    "slow_getitem": (slow_getitem, "DATA_LOADING"),
    "item_in_loop": (item_in_loop, "SYNC_STALL"),
    "sync_logging": (sync_logging, "SYNC_STALL"),
    "pageable_copy": (pageable_copy, "MEMCPY_PAGEABLE"),
    "fp32_matmul": (fp32_matmul, "LOW_TENSOR_CORE"),
    "healthy": (healthy, "no high finding"),
}


def main() -> int:
    if not torch.cuda.is_available():
        print("capture.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(OUT, exist_ok=True)
    only = set(sys.argv[1:])
    manifest = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
                "scenarios": {}}
    rc = 0
    for name, (fn, expect) in SCENARIOS.items():
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            path = fn()
        except Exception as exc:  # keep going: one broken scenario must not cost the others
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
            manifest["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            rc = 1
            continue
        size = os.path.getsize(path)
        ok = size <= MAX_BYTES
        rc |= 0 if ok else 1
        manifest["scenarios"][name] = {"file": os.path.basename(path), "bytes": size, "expect": expect,
                                       "seconds": round(time.time() - t0, 1)}
        print(f"{name}: {size / 1e6:.2f} MB{'' if ok else ' (OVER 1.5 MB)'} expect {expect}")
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "scenarios.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
