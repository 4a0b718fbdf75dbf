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
  ddp_compile   4-rank DDP, eager (= ddp_healthy) -> torch.compile of the DDP model (DDP's graph split at
                its buckets): what UNCOMPILED_KERNEL_RUNS prices, on a job whose ranks all-reduce
  fsdp_healthy  4-rank FSDP2 (fully_shard per block), no fault

GPU-kernel cases (issue 29), on a nanoGPT-style model (its attention through
F.scaled_dot_product_attention) at 48 sequences unless --batch says otherwise (GPU-bound on an H100):
  pointwise     GELU and LayerNorm written out in elementwise ops (nanoGPT's old new_gelu, a
                mean/var/normalise LayerNorm) -> F.gelu(approximate="tanh"), F.layer_norm
  attention     eager attention (q @ k^T, scale, causal masked_fill, softmax, dropout, @ v) ->
                F.scaled_dot_product_attention(is_causal=True, dropout_p=DROPOUT)
  gate          a negative control: the same written-out GELU over one gate vector of d elements
                per block (a few tiny kernels) -> F.gelu of it
  tf32          no autocast: fp32 matmuls with TF32 off (PyTorch's default) -> TF32 allowed
  anomaly       torch.autograd.set_detect_anomaly(True) -> off
  zerograd      opt.zero_grad(set_to_none=False) -> set_to_none=True
  compile       the eager model (the healthy nanoGPT job) -> torch.compile(model) (default mode,
                compiled in the warm-up steps): what fusion saves on a healthy job
  h2d           a 48 MiB fp32 feature tensor (added to the embeddings) copied to the GPU every
                step from pageable memory -> from pinned memory, non_blocking
  gradnorm      every gradient's norm read with .item() each step (a sync per parameter) ->
                the norms stacked on the GPU and read once
  emptycache    torch.cuda.empty_cache() every step -> none
  channels      a ResNet-style convolutional net (bf16 autocast, 256 images of 3 x 224 x 224, 1000
                classes) in the default NCHW layout -> model and images channels_last (NHWC)
  lncompile     the eager model -> its LayerNorms alone compiled (torch.compile per LayerNorm module):
                what a generated LayerNorm backward saves over ATen's (SM_ARRAY_IDLE's remedy for its
                gamma/beta kernel of 16 blocks)
  vocab         GPT-2's vocabulary of 50257 tokens (the LM head's matmuls have an odd dimension: no
                16-byte aligned tensor-core kernel) -> padded to 50304, a multiple of 64 (nanoGPT's fix)
  cudnnbench    a negative control, most likely: the channels_last ResNet with cuDNN's heuristics
                (torch.backends.cudnn.benchmark = False, the default) -> benchmark = True, shapes fixed
  nvtx          the plain eager job (as launch) with every step inside torch.autograd.profiler.emit_nvtx()
                (a range pushed per op, no Nsight attached) -> without it: a debugging API left on
  hfattn        transformers' GPT-2 (6 layers of 512, vocabulary 8192, GELU tanh) with
                attn_implementation="eager" -> "sdpa": a model file aiprof was not written against
  compile_hf    hfattn's fix (transformers' GPT-2, sdpa; eager) -> torch.compile(model)
  compile_resnet channels' fix (the channels_last ResNet; eager) -> torch.compile(model): what fusion
                saves on two more healthy jobs, models the fusion price was not fitted on

Distributed cases on 4 ranks (issue 29), the GPT model of Block at --batch sequences per rank:
  fsdp_reshard  FSDP2 fully_shard per block with reshard_after_forward=True (the default: every block's
                parameters all-gathered again in backward) -> reshard_after_forward=False per block
  fsdp_wrap     FSDP2 fully_shard on the whole model only (one unit: every parameter all-gathered at the
                forward's start and every gradient reduce-scattered after the backward, nothing to
                overlap them with) -> fully_shard per block, then the root (= fsdp_healthy)
  fsdp_units    fsdp_wrap reversed: fully_shard per block, then the root (= fsdp_healthy: seven units, each
                with its hooks' host work every step) -> fully_shard on the whole model only (one unit)
  fsdp_groups   the same per-block job -> fully_shard on each group of three blocks (a list of modules: one unit each),
                then the root: three units instead of seven
  fsdp_compile  fsdp_reshard's fault (eager, host-bound at 48 sequences) -> each block's forward compiled
                (torch.compile(block.forward), FSDP's hooks left eager): LAUNCH_BOUND's remedy on an FSDP job
  fsdp1_prefetch FSDP1 (FullyShardedDataParallel, one unit per block) with backward_prefetch=None -> the
                default BackwardPrefetch.BACKWARD_PRE: without it each block's all-gather in backward is
                issued after the previous block's reduce-scatter, and NCCL runs the two in issue order
  fsdp1_post    the same with BackwardPrefetch.BACKWARD_POST (each block's all-gather issued from the post-backward
                hook of the block after it: ahead of its reduce-scatter, after its compute) -> BACKWARD_PRE
  fsdp_accum    FSDP2 per block (fsdp_healthy) with gradient accumulation: ACCUM micro-batches of --batch
                sequences per optimizer step, every backward reduce-scattering its gradients -> the same
                with model.set_requires_gradient_sync(False) on every micro-batch but the last (FSDP2's
                no_sync: one reduce-scatter per unit and step, the unsharded gradients kept between them)
  fsdp1_accum   fsdp_accum on FSDP1 (one unit per block, BACKWARD_PRE) -> `with model.no_sync():` around every
                micro-batch but the last
  ddp_unused    DDP(find_unused_parameters=True) on a model that uses every parameter -> False (default)
  dataparallel  nn.DataParallel over every visible GPU in one process (run it on 1 rank: torchrun
                --nproc-per-node 1), --batch sequences per GPU -> DDP, one process per GPU (4 ranks)

--times writes {"ms_per_step": ..., "steps": N, "window": [first, last)}: the wall time of the
steps [warm, warm + steps) between two device syncs (rank 0 for distributed cases).
--step-log PREFIX writes PREFIX.rank<R>.json on every rank: per step (warm-up included) its host
wall ms, the main thread's CPU ms (time.thread_time: no blocked time) and every thread's CPU ns at
its start (schedstat; names by tid), so that ranks' host work can be compared with and without the
profiler (bench/diagnosis/host_symmetry.sh).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 8192
WARM = 10  # steps before the timed window; `aiprof run --skip 10` captures from the same step
STALL_STEP = WARM + 1  # inside both the timed window and a 3-iteration capture after --skip WARM
STALL_S = 0.080
FILE_BYTES = 256 << 20
LIVE_OBJECTS = 3_000_000
DROPOUT = 0.1  # attention-probability dropout, in both variants of the attention case
#: the cases on the nanoGPT-style model (NanoBlock), and their default sequences per step
# fsdp_groups' fix: blocks per FSDP unit
GROUP_BLOCKS = 3
NANO_CASES = ("pointwise", "attention", "gate", "tf32", "anomaly", "zerograd", "compile", "h2d", "gradnorm",
              "emptycache", "lncompile", "vocab", "hfattn", "compile_hf")
NANO_BATCH = 48
#: micro-batches per optimizer step of the fsdp_accum case (each of --batch sequences)
ACCUM = 4
#: GPT-2's vocabulary, and nanoGPT's padding of it to a multiple of 64 (the vocab case)
GPT2_VOCAB, PADDED_VOCAB = 50257, 50304
#: images per step of the channels case: at 64 its step is host-bound on an H100 (launches), at 256 GPU-bound
CHANNELS_BATCH = 256


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


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) written out, as nanoGPT and many model files once did."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class WrittenLayerNorm(nn.LayerNorm):
    """LayerNorm written out in elementwise ops and reductions (the fault of the pointwise case)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class NanoBlock(nn.Module):
    """A nanoGPT block: causal self-attention (fused, or eager with ``eager_attention``) and an
    MLP; ``written`` writes its GELU and LayerNorms out; ``gate`` scales the MLP's output by a
    written-out GELU of a d-element parameter (or F.gelu of it, ``gate == "fused"``)."""

    def __init__(self, d: int, heads: int, seq: int, eager_attention: bool = False, written: bool = False,
                 gate: str = "") -> None:
        super().__init__()
        norm = WrittenLayerNorm if written else nn.LayerNorm
        self.ln1, self.ln2 = norm(d), norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.eager, self.written, self.gate_kind = heads, eager_attention, written, gate
        self.gate = nn.Parameter(torch.ones(d)) if gate else None
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.eager:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:n, :n], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = F.dropout(att, DROPOUT, self.training)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = new_gelu(h) if self.written else F.gelu(h, approximate="tanh")
        y = self.out(h)
        if self.gate is not None:
            y = y * (new_gelu(self.gate) if self.gate_kind == "written" else F.gelu(self.gate, approximate="tanh"))
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ConvBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.short(x))


class ResNet(nn.Module):
    """A ResNet-18-shaped image classifier (the channels case)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        widths, layers, cin = (64, 128, 256, 512), [], 64
        for i, w in enumerate(widths):
            layers += [ConvBlock(cin, w, 1 if i == 0 else 2), ConvBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 512, layers: int = 6, heads: int = 8, seq: int = 1024,
                 block=None, written_norm: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList((block or Block)(d, heads) for _ in range(layers))
        self.ln = WrittenLayerNorm(d) if written_norm else nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        if features is not None:
            x = x + features
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class Logits(nn.Module):
    """A transformers causal LM called as the GPT above: token ids in, logits out."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--variant", choices=("fault", "fix"), required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--times", default="")
    ap.add_argument("--step-log", default="", help="per-step host wall and CPU ms, per rank (see above)")
    ap.add_argument("--batch", type=int, default=0,
                    help="sequences per rank (default 8, 48 for the nanoGPT cases; 48 makes the step "
                         "GPU-bound on an H100: the 4-rank pairs)")
    ap.add_argument("--cpu", action="store_true", help="a smoke test of the script on a machine without a GPU")
    a = ap.parse_args()
    fault = a.variant == "fault"
    dist_case = a.case.startswith(("ddp", "fsdp")) or (a.case == "dataparallel" and not fault)
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
    seq, batch = 512, a.batch or (NANO_BATCH if a.case in NANO_CASES else 8)
    block = None
    if a.case in NANO_CASES:
        def block(d: int, heads: int) -> NanoBlock:
            return NanoBlock(d, heads, 2 * seq, eager_attention=fault and a.case == "attention",
                             written=fault and a.case == "pointwise",
                             gate=("written" if fault else "fused") if a.case == "gate" else "")
    vocab = (GPT2_VOCAB if fault else PADDED_VOCAB) if a.case == "vocab" else VOCAB
    resnet = a.case in ("channels", "cudnnbench", "compile_resnet")
    if resnet:
        model = ResNet().to(dev)
        if not fault or a.case in ("cudnnbench", "compile_resnet"):
            model = model.to(memory_format=torch.channels_last)
        if a.case == "cudnnbench":
            torch.backends.cudnn.benchmark = not fault
    elif a.case in ("hfattn", "compile_hf"):
        from transformers import AutoModelForCausalLM, GPT2Config

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * seq, n_embd=512, n_layer=6, n_head=8,
                         activation_function="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)
        eager = fault and a.case == "hfattn"
        model = Logits(AutoModelForCausalLM.from_config(cfg, attn_implementation="eager" if eager else "sdpa")).to(dev)
    else:
        model = GPT(vocab=vocab, seq=2 * seq, block=block, written_norm=fault and a.case == "pointwise").to(dev)
    autocast = not (a.case == "tf32")  # the tf32 case runs in fp32: TF32 is its only difference
    if a.case == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = not fault
    if a.case == "anomaly" and fault:
        torch.autograd.set_detect_anomaly(True)
    if a.case == "dataparallel" and fault:
        model = nn.DataParallel(model)  # one process: the model replicated to every visible GPU each step
    elif a.case in ("ddp_uneven", "ddp_healthy", "ddp_unused", "dataparallel", "ddp_compile"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local], find_unused_parameters=fault and a.case == "ddp_unused")
    elif a.case in ("fsdp_healthy", "fsdp_reshard", "fsdp_wrap", "fsdp_compile", "fsdp_units", "fsdp_groups",
                    "fsdp_accum"):
        from torch.distributed.fsdp import fully_shard

        # fsdp_reshard's fix keeps each block's gathered parameters from forward to backward;
        # fsdp_wrap's fault and fsdp_units' fix have no unit but the root
        root_only = (a.case == "fsdp_wrap" and fault) or (a.case == "fsdp_units" and not fault)
        grouped = a.case == "fsdp_groups" and not fault
        for g0 in range(0, len(model.blocks), GROUP_BLOCKS) if grouped else ():
            fully_shard(list(model.blocks[g0:g0 + GROUP_BLOCKS]))  # one unit for the group's parameters
        for b in model.blocks if not (root_only or grouped) else ():
            if a.case == "fsdp_compile" and not fault:  # the block's compute compiled, FSDP's hooks around it eager
                b.forward = torch.compile(b.forward)
            fully_shard(b, reshard_after_forward=not (a.case == "fsdp_reshard" and not fault))
        fully_shard(model)
    elif a.case in ("fsdp1_prefetch", "fsdp1_post", "fsdp1_accum"):
        from torch.distributed.fsdp import BackwardPrefetch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=dev, use_orig_params=True,
                     backward_prefetch=(BackwardPrefetch.BACKWARD_PRE if not fault or a.case == "fsdp1_accum" else
                                        None if a.case == "fsdp1_prefetch" else BackwardPrefetch.BACKWARD_POST))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    graphs = a.case == "launch" and not fault
    if graphs:  # the optimizer stays eager, as in the fault; only the forward/backward is graphed
        model = torch.compile(model, mode="reduce-overhead")
    if a.case in ("compile", "compile_hf", "compile_resnet", "ddp_compile") and not fault:
        model = torch.compile(model)
    if a.case == "lncompile" and not fault:
        for b in model.blocks:
            b.ln1, b.ln2 = torch.compile(b.ln1), torch.compile(b.ln2)
        model.ln = torch.compile(model.ln)
    features = None
    if a.case == "h2d":  # made once on the host; copied every step (pageable: staged and blocking)
        features = torch.randn(batch, seq, 512) * 0.01
        if not fault and not a.cpu:
            features = features.pin_memory()
    n_seq = 2 * seq if (a.case == "ddp_uneven" and fault and rank == 0) else seq
    # DataParallel splits one batch over the GPUs: as many sequences in all as the DDP ranks have
    rows = batch * torch.cuda.device_count() if a.case == "dataparallel" and fault and not a.cpu else batch
    x = torch.randint(0, 8192, (rows, n_seq), device=dev)
    if resnet:  # images and their labels, made once on the GPU
        images = torch.randn(a.batch or CHANNELS_BATCH, 3, 224, 224, device=dev)
        if not fault or a.case in ("cudnnbench", "compile_resnet"):
            images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (images.shape[0],), device=dev)
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
        feats = features.to(dev, non_blocking=not fault) if features is not None else None
        micro = ACCUM if a.case in ("fsdp_accum", "fsdp1_accum") else 1
        for k in range(micro):
            if micro > 1 and not fault and a.case == "fsdp_accum":  # FSDP2: reduce-scatter after the last only
                model.set_requires_gradient_sync(k == micro - 1)
            # FSDP1's no_sync() around every micro-batch but the last (forward and backward)
            sync = model.no_sync() if micro > 1 and not fault and a.case == "fsdp1_accum" and k < micro - 1 \
                else contextlib.nullcontext()
            with sync:
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                    if resnet:
                        loss = nn.functional.cross_entropy(model(images).float(), labels)
                    else:
                        logits = model(x, feats) if feats is not None else model(x)
                        loss = nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), x.view(-1))
                (loss / micro if micro > 1 else loss).backward()
        if a.case == "gradnorm":
            grads = [p.grad for p in model.parameters()]
            norms = [g.norm().item() for g in grads] if fault else torch.stack([g.norm() for g in grads]).tolist()
            assert len(norms) == len(grads)
        opt.step()
        opt.zero_grad(set_to_none=not (fault and a.case == "zerograd"))
        if fault and a.case == "emptycache":
            torch.cuda.empty_cache()
        if fault and a.case == "gc":
            gc.collect()
        if fault and a.case == "ckpt":
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
        if fault and a.case == "print":
            print(f"step {i} loss {loss}", flush=True)

    # the nvtx fault: every step inside emit_nvtx (an autograd-profiler mode: a range per op)
    nvtx = torch.autograd.profiler.emit_nvtx() if a.case == "nvtx" and fault else contextlib.nullcontext()
    nvtx.__enter__()
    log: dict[str, list] = {"wall_ms": [], "cpu_ms": [], "threads": []}

    def thread_ns() -> dict[int, int]:
        """Every thread's CPU ns so far (schedstat's first field), by tid."""
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    out[int(tid)] = int(f.read().split()[0])
            except OSError:
                pass
        return out

    def logged(i: int) -> None:
        log["threads"].append(thread_ns())
        w, c = time.perf_counter(), time.thread_time()
        step(i)
        log["cpu_ms"].append(round((time.thread_time() - c) * 1e3, 3))
        log["wall_ms"].append(round((time.perf_counter() - w) * 1e3, 3))

    run_step = logged if a.step_log else step
    t_warm = time.perf_counter()
    for i in range(WARM):
        run_step(i)
    torch.cuda.synchronize()
    if graphs:  # the compile and graph recording must be done before the window (and the capture)
        from torch._dynamo.utils import counters

        print(f"launch fix: {WARM} warm-up steps took {time.perf_counter() - t_warm:.1f} s; "
              f"dynamo {dict(counters['stats'])}", flush=True)
    t0 = time.perf_counter()
    for i in range(WARM, WARM + a.steps):
        run_step(i)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / a.steps
    if a.step_log:
        log["threads"].append(thread_ns())
        names = {}
        for tid in log["threads"][-1]:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names[tid] = f.read().strip()
            except OSError:
                pass
        with open(f"{a.step_log}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "names": names, **log}, f)
    nvtx.__exit__(None, None, None)
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
