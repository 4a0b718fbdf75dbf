"""GPT-2 small training loop on one GPU (copied from the probes): `forever` is the attach target.

Used to (1) time torch.profiler overhead per configuration, (2) capture real
Kineto traces with a known anomaly (ground truth: step SLOW has an 80 ms
sleep inside get_batch, so the GPU idles), (3) be a target for attach tests.
"""
import gzip, os, shutil, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel

OUT = os.environ.get("OUT", "/tmp/out")
MODE = sys.argv[1] if len(sys.argv) > 1 else "overhead"
torch.manual_seed(0)
dev = "cuda"
cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
model = GPT2LMHeadModel(cfg).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
B, T = 8, 1024
SLOW = int(os.environ.get("SLOW_STEP", "-1"))


def get_batch(i):
    x = torch.randint(0, 50257, (B, T))
    if i == SLOW:
        time.sleep(0.08)
    return x.to(dev)


def train_step(i):
    x = get_batch(i)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, labels=x)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss


def timed(n, prof=None, start=0):
    ts = []
    for i in range(start, start + n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(i)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        if prof is not None:
            prof.step()
    return ts


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


if MODE == "overhead":
    from torch.profiler import profile, ProfilerActivity, schedule
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    timed(10)
    configs = {
        "kineto": dict(),
        "shapes_flops": dict(record_shapes=True, with_flops=True),
        "stack": dict(with_stack=True),
        "memory": dict(profile_memory=True),
        "all": dict(record_shapes=True, with_flops=True, with_stack=True, profile_memory=True),
    }
    res = {}
    base = []
    for rep in range(2):
        base += timed(15)
        for name, kw in configs.items():
            with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=12), **kw) as p:
                ts = timed(13, p)
            res.setdefault(name, []).extend(ts[1:])
    b = med(base)
    print("baseline_step_ms", round(b * 1e3, 2))
    for name, ts in res.items():
        print("overhead", name, "step_ms", round(med(ts) * 1e3, 2), "ratio", round(med(ts) / b, 3))
elif MODE == "trace":
    from torch.profiler import profile, ProfilerActivity, schedule
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    timed(5)
    kw = dict(record_shapes=True, with_flops=True, with_stack=True, profile_memory=True)
    if os.environ.get("LIGHT"):
        kw = {}
    name = os.environ.get("NAME", "gpt2_train")
    path = f"/tmp/{name}.json"
    if os.environ.get("MEMSNAP"):
        torch.cuda.memory._record_memory_history(max_entries=20000)

    def ready(p):
        p.export_chrome_trace(path)

    with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=5, repeat=1), on_trace_ready=ready, **kw) as p:
        ts = timed(7, p, start=100)
    print("trace step ms", [round(t * 1e3, 1) for t in ts])
    if os.environ.get("MEMSNAP"):
        import pickle
        snap = torch.cuda.memory._snapshot()
        with gzip.open(f"{OUT}/{name}_memsnap.pickle.gz", "wb") as g:
            pickle.dump(snap, g)
        torch.cuda.memory._record_memory_history(enabled=None)
    sz = os.path.getsize(path)
    with open(path, "rb") as f, gzip.open(f"{OUT}/{name}.json.gz", "wb", 6) as g:
        shutil.copyfileobj(f, g)
    print("trace bytes", sz, "gz", os.path.getsize(f"{OUT}/{name}.json.gz"))
elif MODE == "steps":
    # a fixed number of steps, then exit: the target of `aiprof run` captures
    n = int(os.environ.get("STEPS", "40"))
    ts = timed(n)
    print("steps", n, "median ms", round(med(ts) * 1e3, 2), flush=True)
elif MODE == "forever":
    # unmodified-looking loop, target for attach/injection tests
    i = 0
    t_last = time.perf_counter()
    while True:
        train_step(i)
        i += 1
        if i % 50 == 0:
            torch.cuda.synchronize()
            now = time.perf_counter()
            print("step", i, "ms/step", round((now - t_last) * 1e3 / 50, 2), flush=True)
            t_last = now
