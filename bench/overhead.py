"""Step-time overhead of the aiprof agent vs raw torch.profiler, in one process, as ratios.

Segments, repeated ``--rounds`` times and interleaved so drift hits every mode alike:

- ``none``: no agent hook (the optimizer hook removed, control thread stopped);
- ``idle``: the agent installed and waiting (hook + control thread);
- ``agent:<level>``: an agent capture of ``--active`` iterations at that richness;
- ``raw:<level>``: torch.profiler with the same options (schedule warmup=1, active=N), stepped
  outside the timed region as the probes did;
- ``after``: idle again once the capture has been exported (CUPTI torn down).

Each step is timed with a device synchronize before and after ``train_step`` (which contains
the optimizer step, hence the agent's hook). Per segment the median step time is kept; the
report is the median over rounds, divided by ``none``'s.

    python bench/overhead.py                      # GPT-2 small on CUDA (transformers)
    python bench/overhead.py --model tiny --steps 20 --rounds 1   # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from aiprof.agent.bootstrap import ensure_agent  # noqa: E402
from aiprof.protocol import CaptureRequest  # noqa: E402
from aiprof.agent.control import ControlServer  # noqa: E402

LEVELS = {  # name -> (aiprof --what, torch.profiler kwargs)
    "kernels": ("kernels", {}),
    "python": ("kernels,python", {"with_stack": True}),
    "shapes": ("kernels,shapes", {"record_shapes": True}),
    "memory": ("kernels,memory", {"profile_memory": True}),
    "flops": ("kernels,flops", {"with_flops": True}),
    "hw": ("kernels,hw", None),  # NVML/GPM + CUPTI PM sampling at 100 µs
    "hw-nopm": ("kernels,hw", None),  # NVML/GPM only (--hw-pm-interval-us 0)
    "all": ("all", {"record_shapes": True, "with_stack": True, "profile_memory": True, "with_flops": True}),
}


def build(model: str, device: str):
    """Return train_step() for the chosen workload."""
    torch.manual_seed(0)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
        m = GPT2LMHeadModel(cfg).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        B, T = 8, 1024

        def step() -> None:
            x = torch.randint(0, 50257, (B, T)).to(device)
            with torch.autocast(device, dtype=torch.bfloat16):
                out = m(x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    width = 512
    m = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step() -> None:
        x = torch.randn(64, width, device=device)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(step, n: int, device: str, after_each=None) -> list[float]:
    ts = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        ts.append(time.perf_counter() - t0)
        if after_each is not None:
            after_each()
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt2", "tiny"], default="gpt2")
    ap.add_argument("--steps", type=int, default=40, help="steps per none/idle/after segment")
    ap.add_argument("--active", type=int, default=12, help="recorded iterations per capture")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--pretouch-gb", type=int, default=0, help="touch this much host memory first (VMs that grow memory lazily)")
    ap.add_argument("--out", default=None, help="folder for captures and results.json (default: a temp dir)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    out = args.out or tempfile.mkdtemp(prefix="aiprof-bench-")
    os.makedirs(out, exist_ok=True)
    step = build(args.model if device == "cuda" else "tiny", device)
    timed(step, 10, device)  # warm-up: allocator, cuBLAS handles, autotuning

    rt = tempfile.mkdtemp(prefix="aiprof-bench-rt-")
    agent = ensure_agent("bench", rt)

    def agent_off() -> None:
        agent.tracker.remove_optimizer_hook()
        agent.control.close()

    def agent_on() -> None:
        agent.tracker.install_optimizer_hook()
        agent.control = ControlServer(agent, rt)
        agent.control.start()

    def settle() -> None:
        """Outside the timed region: collect the profiler's garbage now, not during steps."""
        gc.collect()
        time.sleep(0.2)

    # This VM's memory grows on first touch (seconds per 8 GiB): touch some once, up front,
    # so that the first large trace export does not stall the steps measured after it.
    if args.pretouch_gb > 0:
        bytearray(args.pretouch_gb << 30)  # allocated, zeroed (touched), freed
    levels = [lv for lv in args.levels.split(",") if lv]
    seg: dict[str, list[float]] = {}
    def add(name: str, ts: list[float]) -> None:
        seg.setdefault(name, []).append(statistics.median(ts))

    from torch.profiler import ProfilerActivity, profile, schedule
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for r in range(args.rounds):
        agent_off()
        settle()
        add("none", timed(step, args.steps, device))
        agent_on()
        add("idle", timed(step, args.steps, device))
        for lv in levels:
            what, raw_kw = LEVELS[lv]
            # agent capture: one warm-up iteration, then `active` recorded
            def agent_capture() -> None:
                req = CaptureRequest(out=out, capture_id=f"bench-r{r}-{lv}", what=what, skip=1,
                                     iterations=args.active,
                                     hw_pm_interval_us=0 if lv == "hw-nopm" else 100).normalised()
                assert agent.driver.submit(req) is None
                ts = timed(step, args.active + 2, device)
                t_wait = time.monotonic()
                while agent.driver.state != "idle" and time.monotonic() - t_wait < 120:
                    time.sleep(0.05)
                add(f"agent:{lv}", ts[2:])  # drop the warm-up step and the start step
                settle()
                add(f"after:{lv}", timed(step, args.steps // 2, device))

            def raw_capture() -> None:
                if raw_kw is None:
                    return
                with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=args.active), **raw_kw) as p:
                    ts = timed(step, args.active + 1, device, after_each=p.step)
                del p
                add(f"raw:{lv}", ts[1:])
                settle()

            # alternate which goes first, so slow drift does not favour one side
            for fn in ((agent_capture, raw_capture) if r % 2 == 0 else (raw_capture, agent_capture)):
                fn()
        add("after", timed(step, args.steps, device))
        print(f"round {r} done", file=sys.stderr, flush=True)

    base = statistics.median(seg["none"])
    idle = statistics.median(seg["idle"])
    rows = []
    for name, vals in seg.items():
        med = statistics.median(vals)
        rows.append({"segment": name, "step_ms": round(med * 1e3, 3), "ratio_vs_none": round(med / base, 4),
                     "per_round_ms": [round(v * 1e3, 3) for v in vals]})
    after_all = [v for k, vs in seg.items() if k.startswith("after") for v in vs]
    res = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": args.model if device == "cuda" else "tiny", "torch": torch.__version__,
        "steps_per_segment": args.steps, "active": args.active, "rounds": args.rounds,
        "rows": rows,
        "after_vs_idle_ratio": round(statistics.median(after_all) / idle, 4),
    }
    with open(os.path.join(out, "overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'segment':16s} {'step_ms':>9s} {'x none':>7s}   {'raw x none':>10s}")
    for row in rows:
        name = row["segment"]
        if name.startswith(("raw:", "after:")):
            continue
        raw = next((x for x in rows if x["segment"] == "raw:" + name.split(":", 1)[-1]), None) if name.startswith("agent:") else None
        print(f"{name:16s} {row['step_ms']:9.3f} {row['ratio_vs_none']:7.4f}   {raw['ratio_vs_none'] if raw else '':>10}")
    print(f"after capture vs before (idle): {res['after_vs_idle_ratio']}")
    res["traces"] = _trace_costs(out, levels, args.rounds)
    with open(os.path.join(out, "overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'level':16s} {'trace MB gz':>11s} {'MB JSON':>8s} {'ingest CPU s':>12s}  (median over rounds; --no-cache ingest)")
    for lv, t in res["traces"].items():
        print(f"{lv:16s} {t['gz_mb']:11.2f} {t['json_mb']:8.1f} {t['ingest_cpu_s']:12.3f}")
    print("results:", os.path.join(out, "overhead.json"))


def _trace_costs(out: str, levels: list[str], rounds: int) -> dict:
    """Per level, what its agent captures cost after the job: the trace's size (gzipped and as
    JSON) and aiprof's ingest of it (this process's CPU seconds, parsed afresh), median over rounds."""
    import glob
    import gzip

    from aiprof.trace.store import ingest

    os.environ["AIPROF_INGEST_WORKERS"] = "1"
    first = glob.glob(os.path.join(out, "bench-r0-*", "**", "*.json.gz"), recursive=True)
    if first:
        ingest(first[0], 0, None, False)  # untimed: the first ingest pays the lazy imports
    costs = {}
    for lv in levels:
        gz, raw, cpu = [], [], []
        for r in range(rounds):
            for f in glob.glob(os.path.join(out, f"bench-r{r}-{lv}", "**", "*.json.gz"), recursive=True):
                gz.append(os.path.getsize(f) / 1e6)
                with gzip.open(f) as fh:
                    raw.append(len(fh.read()) / 1e6)
                t = time.process_time()
                ingest(f, 0, None, False)
                cpu.append(time.process_time() - t)
        if gz:
            costs[lv] = {"gz_mb": statistics.median(gz), "json_mb": statistics.median(raw),
                         "ingest_cpu_s": statistics.median(cpu), "traces": len(gz)}
    return costs


if __name__ == "__main__":
    main()
