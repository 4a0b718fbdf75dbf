#!/usr/bin/env python3
"""A real serving engine under aiprof: transformers' continuous batching, driven by a client.

    PYTHONPATH=src python bench/serving/gpu_serving.py          # on the GPU machine; writes to $OUT
    PYTHONPATH=src python bench/serving/gpu_serving.py --cpu    # a tiny model on the CPU (logic check)

What it does, each phase on its own (an error is recorded in summary.json and the next phase runs):

1. builds a small Llama from a config (random weights: no download), bf16 on the GPU;
2. a client submits requests of mixed prompt and output lengths to a ContinuousBatchingManager
   (the first half at once, the rest staggered) once the engine's loop runs, and measures tokens/s
   (generated tokens over the wall time from the first submission to the last completion); the engine's own steps are
   counted (manager.current_batch) and, per step, what its scheduler put in the batch (requests
   prefilling / decoding, query tokens): the engine's knowledge of prefill and decode;
3. unprofiled rounds of the baseline (CUDA graphs off) alternating with the remedies: CUDA graphs
   on (the remedy of DECODE_LAUNCH_BOUND) and 4x the requests in flight (SMALL_BATCH's);
4. one baseline round under raw torch.profiler, started inside the engine's thread (the profiler
   records the host ops of the thread that starts it): raw_trace.json.gz;
5. the same workload as a child process under `python -m aiprof run --entry
   ...ContinuousBatchingManager._generation_loop_body` (the agent's flow): agent_trace.json.gz and
   agent_meta.json;
6. HOST_SAMPLING's scenario: a hand-written decode loop that copies the logits to the CPU and
   samples there, profiled (host_sampling_trace.json.gz), and timed unprofiled against sampling
   on the GPU (its remedy);
7. after each capture, aiprof's analysis of it (`aiprof analyze --json` in a child process with a
   time limit): iterations found, phases vs the engine's, tokens/s vs the client's, the causes and
   their predicted speed-ups vs the measured remedies: analysis.json.

Phases run in order of importance (the raw capture and its analysis before the agent's), each
only if its usual time is left.

Outputs under $OUT (at most 7 files): summary.json, raw_trace.json.gz, agent_trace.json.gz,
agent_meta.json, host_sampling_trace.json.gz, analysis.json, log.txt. Finishes within --budget-s
(default 230 s).
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "transformers.generation.continuous_batching.continuous_api:ContinuousBatchingManager._generation_loop_body"
# The engine-step log is kept for at most this many steps per round (a JSON of a few hundred KB).
MAX_STEP_LOG = 2000
# The unprofiled rounds start no new round after this many seconds (the captures need the rest).
ROUNDS_MAX_S = 60.0
# SMALL_BATCH's remedy as measured: this many times the requests in flight.
BATCH_FACTOR = 4

LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    LOG.append(line)
    print(line, flush=True)


# ---------------------------------------------------------------------------------------- workload
def workload(cpu: bool, scale: int = 1) -> list[dict]:
    """Requests: prompt length, new tokens, arrival offset (s). Mixed lengths; half arrive at once."""
    if cpu:
        prompts, news, n, gap = [5, 17, 40, 9, 60, 3, 25, 11], [8, 12, 16, 10], 8, 0.005
    else:
        prompts, news, n, gap = [24, 96, 384, 48, 640, 160, 32, 256], [32, 48, 64, 40], 16, 0.015
    n *= scale
    out = []
    for i in range(n):
        arrival = 0.0 if (i < n // 2 or scale > 1) else (i - n // 2 + 1) * gap
        out.append({"prompt": prompts[i % len(prompts)], "new": news[i % len(news)], "arrival": arrival})
    return out


def build_model(cpu: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if cpu:
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        dtype, dev = torch.float32, "cpu"
    else:
        # 4 layers: a whole run's trace with Python stacks stays under 15 MB gzipped
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
        dtype, dev = torch.bfloat16, "cuda"
    try:
        cfg._attn_implementation = "sdpa"  # continuous batching accepts sdpa; flash is not installed
    except (AttributeError, ValueError) as exc:
        log(f"  attention implementation left as is: {exc!r}")
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=dtype).eval()
    return model


def _filtered(cls, kw: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(
        inspect.signature(cls).parameters)
    return {k: v for k, v in kw.items() if k in names}


def cb_configs(model, cpu: bool, cuda_graph: bool, max_requests: int):
    """(GenerationConfig, ContinuousBatchingConfig or None) for this transformers version."""
    from transformers import GenerationConfig

    kw = {"page_size": 32 if cpu else 64, "num_blocks": 64 if cpu else 512,
          "max_batch_tokens": 64 if cpu else 512, "max_requests_per_batch": max_requests,
          "use_cuda_graph": bool(cuda_graph), "auto_switch_to_flash": False, "use_async_batching": False}
    gc = GenerationConfig(max_new_tokens=128, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # older 5.x: the settings live on the generation config
        for k, v in kw.items():
            setattr(gc, "block_size" if k == "page_size" else k, v)
        return gc, None
    return gc, ContinuousBatchingConfig(**_filtered(ContinuousBatchingConfig, kw))


# ------------------------------------------------------------------------------- engine knowledge
STEP_LOG: list[dict] = []
_PATCHED = []


def _generated(fs) -> int:
    st = getattr(fs, "state", fs)
    g = getattr(st, "generated_len", None)
    if callable(g):
        return int(g())
    return len(getattr(st, "generated_tokens", None) or getattr(st, "static_outputs", None) or [])


def instrument_scheduler() -> None:
    """Record what the engine's scheduler puts in every batch (its own prefill/decode knowledge)."""
    if _PATCHED:
        return
    from transformers.generation.continuous_batching import scheduler as sch

    for cls in {c for c in vars(sch).values() if isinstance(c, type) and "schedule_batch" in vars(c)}:
        orig = cls.schedule_batch

        def wrapped(self, *a, __orig=orig, **k):
            res = __orig(self, *a, **k)
            try:
                batch = res[0] if isinstance(res, tuple) else res
                if batch and len(STEP_LOG) < MAX_STEP_LOG:
                    # a request that has generated tokens decodes; one that has not is in its prompt
                    dec = [_generated(fs) > 0 for fs in batch]
                    q = [int(getattr(fs, "query_length", 0) or 0) for fs in batch]
                    STEP_LOG.append({
                        "t": time.perf_counter(), "requests": len(batch), "query_tokens": sum(q),
                        "prefilling": dec.count(False), "decoding": dec.count(True),
                        "new_tokens": sum(bool(getattr(fs, "has_new_token", False)) for fs in batch),
                        "q_tokens": int(res[2]) if isinstance(res, tuple) and len(res) > 2 and res[2] is not None else None,
                        "decode_fast_path": bool(res[1]) if isinstance(res, tuple) and len(res) > 1 else None})
            except Exception as exc:  # noqa: BLE001 - never break the engine
                log(f"step log: {exc!r}")
            return res

        cls.schedule_batch = wrapped
        _PATCHED.append(cls)


def engine_phases(steps: list[dict]) -> dict:
    """The engine's own counts: steps by phase (all prefilling / all decoding / both)."""
    out = {"prefill": 0, "decode": 0, "mixed": 0}
    for s in steps:
        if s["prefilling"] and not s["decoding"]:
            out["prefill"] += 1
        elif s["decoding"] and not s["prefilling"]:
            out["decode"] += 1
        else:
            out["mixed"] += 1
    return out


# ----------------------------------------------------------------------------------------- client
def run_client(model, reqs: list[dict], cpu: bool, cuda_graph: bool = False, max_requests: int = 32,
               profile_to: str | None = None) -> dict:
    """Serve ``reqs`` through a ContinuousBatchingManager; the client's measurements and the engine's."""
    import torch

    gc, cbc = cb_configs(model, cpu, cuda_graph, max_requests)
    kwargs = {"generation_config": gc}
    if cbc is not None:
        kwargs["continuous_batching_config"] = cbc
    try:
        mgr = model.init_continuous_batching(**kwargs)
    except TypeError:  # a 5.x without the continuous_batching_config argument
        for k, v in dataclasses.asdict(cbc).items() if cbc is not None and dataclasses.is_dataclass(cbc) else ():
            setattr(gc, k, v)
        mgr = model.init_continuous_batching(generation_config=gc)
    if cuda_graph and hasattr(mgr, "warmup"):
        t = time.perf_counter()
        mgr.warmup()
        log(f"  cuda-graph warmup {time.perf_counter() - t:.1f} s")
    prof_done = threading.Event()
    ready = threading.Event()  # the client starts once the engine (and its profiler) runs
    if profile_to:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() and not cpu else [])
        orig = mgr._run_generation_loop

        def loop_under_profiler(*a, **k):  # a private method: any signature passes through
            # the profiler records the host ops of the thread that starts it: start it in the engine's
            try:
                with profile(activities=acts, record_shapes=True, with_stack=True) as p:
                    ready.set()
                    orig(*a, **k)
                p.export_chrome_trace(profile_to)
            finally:
                prof_done.set()

        mgr._run_generation_loop = loop_under_profiler
    rng = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (r["prompt"],), generator=rng).tolist() for r in reqs]
    if not profile_to:
        ready.set()
    STEP_LOG.clear()
    mgr.start()
    # the engine's start-up (its batch processor and KV cache; under the profiler, Kineto and
    # CUPTI) is not serving time: the client starts once the engine's loop runs
    ready.wait(timeout=120)
    limit = time.perf_counter() + 120
    while getattr(mgr, "batch_processor", None) is None and time.perf_counter() < limit:
        time.sleep(0.001)
    t0 = time.perf_counter()
    done: dict[str, dict] = {}
    ids = []
    try:
        for r, p in zip(reqs, prompts):
            wait = t0 + r["arrival"] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            ids.append(mgr.add_request(p, max_new_tokens=r["new"]))
        deadline = time.perf_counter() + 120
        while len(done) < len(ids) and time.perf_counter() < deadline:
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                done[res.request_id] = {"tokens": len(res.generated_tokens), "error": res.error,
                                        "t_done": time.perf_counter() - t0}
        t1 = time.perf_counter()
    finally:
        mgr.stop(block=True, timeout=60)
        steps = int(getattr(mgr, "current_batch", -1))
        if hasattr(mgr, "destroy"):
            mgr.destroy()
    if profile_to:
        prof_done.wait(timeout=120)
    tokens = sum(d["tokens"] for d in done.values())
    wall = t1 - t0
    return {"requests": len(reqs), "finished": len(done), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "engine_steps": steps,
            "engine_phases": engine_phases(STEP_LOG), "engine_new_tokens": sum(s["new_tokens"] for s in STEP_LOG),
            "step_log": list(STEP_LOG), "errors": sorted({str(d["error"]) for d in done.values() if d["error"]})}


def _brief(r: dict) -> str:
    return (f"{r['finished']}/{r['requests']} requests, {r['tokens']} tokens in {r['wall_s']:.3f} s = "
            f"{r['tokens_per_s']:.1f} tokens/s, {r['engine_steps']} engine steps {r['engine_phases']}")


# ------------------------------------------------------------------------------------------ phases
class Runner:
    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.summary: dict = {"schema": "aiprof.bench.serving/1", "cpu": args.cpu, "errors": {}, "phases_s": {}}
        self.model = None

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def phase(self, name: str, fn, need_s: float = 0.0) -> None:
        if self.left() < need_s:
            log(f"skip {name}: {self.left():.0f} s left, needs ~{need_s:.0f}")
            self.summary["errors"][name] = f"skipped: {self.left():.0f} s left"
            return
        t = time.perf_counter()
        log(f"== {name}")
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failed phase is recorded, the next one runs
            self.summary["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"{name} failed: {exc!r}\n{traceback.format_exc()}")
        self.summary["phases_s"][name] = round(time.perf_counter() - t, 2)
        self.write()

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.out / ".summary.json"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        os.replace(tmp, self.out / "summary.json")
        (self.out / "log.txt").write_text("\n".join(LOG) + "\n")

    # -- phases ------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        import transformers

        self.model = build_model(self.args.cpu)
        instrument_scheduler()
        self.summary["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                    "python": sys.version.split()[0]}
        if torch.cuda.is_available() and not self.args.cpu:
            self.summary["device"] = torch.cuda.get_device_name(0)
        cfg = self.model.config
        self.summary["model"] = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                                 "params": sum(p.numel() for p in self.model.parameters())}
        self.summary["workload"] = workload(self.args.cpu)
        # first use: CUDA context, cuBLAS handles, the engine's code paths
        r = run_client(self.model, workload(self.args.cpu)[:4], self.args.cpu)
        log(f"  warm-up: {_brief(r)}")

    def rounds(self) -> None:
        cpu = self.args.cpu
        base, graphs, big = [], [], []
        stop_at = time.perf_counter() + ROUNDS_MAX_S
        for i in range(self.args.rounds):
            if i and time.perf_counter() > stop_at:
                log(f"  rounds stopped after {i}: {ROUNDS_MAX_S:.0f} s used")
                break
            r = run_client(self.model, workload(cpu), cpu)
            log(f"  baseline {i}: {_brief(r)}")
            base.append(r)
            try:
                if not cpu:  # CUDA graphs need a GPU
                    g = run_client(self.model, workload(cpu), cpu, cuda_graph=True)
                    log(f"  cuda graphs {i}: {_brief(g)}")
                    graphs.append(g)
            except Exception as exc:  # noqa: BLE001 - the baseline rounds go on without the remedy
                self.summary["errors"]["cuda_graphs"] = f"{type(exc).__name__}: {exc}"
                log(f"  cuda graphs failed: {exc!r}")
            b = run_client(self.model, workload(cpu, scale=BATCH_FACTOR), cpu, max_requests=BATCH_FACTOR * 32)
            log(f"  4x requests in flight {i}: {_brief(b)}")
            big.append(b)
            self.write_rounds(base, graphs, big)

    def write_rounds(self, base, graphs, big) -> None:
        def med(rs):
            v = sorted(r["tokens_per_s"] for r in rs)
            return v[len(v) // 2] if v else None

        strip = [{k: v for k, v in r.items() if k != "step_log"} for r in base + graphs + big]
        self.summary["unprofiled"] = {
            "baseline_tokens_per_s": med(base), "cuda_graphs_tokens_per_s": med(graphs),
            "batch_x4_tokens_per_s": med(big),
            "cuda_graphs_speedup": (med(graphs) / med(base)) if graphs and base else None,
            "batch_x4_speedup": (med(big) / med(base)) if big and base else None,
            "rounds": strip}
        if base:
            self.summary["engine_step_log_baseline"] = base[-1]["step_log"]

    def raw_profile(self) -> None:
        path = self.out / "raw_trace.json"
        r = run_client(self.model, workload(self.args.cpu), self.args.cpu, profile_to=str(path))
        log(f"  profiled: {_brief(r)}")
        self.summary["profiled_client"] = {k: v for k, v in r.items() if k != "step_log"}
        self.summary["profiled_engine_step_log"] = r["step_log"]
        if path.exists():
            with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()
            self.summary["raw_trace_mb"] = round(os.path.getsize(str(path) + ".gz") / 1e6, 2)

    def agent(self) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="aiprof-serving-"))
        child_json = tmp / "child.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
        iters = 20 if self.args.cpu else 60
        cmd = [sys.executable, "-m", "aiprof", "run", "--entry", ENTRY, "--skip", "10", "--iterations", str(iters),
               "--what", "kernels,python,shapes", "--out", str(tmp / "captures"), "--capture-id", "serving", "--",
               sys.executable, str(Path(__file__).resolve()), "--child", str(child_json)] + (["--cpu"] if self.args.cpu else [])
        log("  " + " ".join(cmd))
        limit = max(30.0, min(150.0, self.left() - 30))
        p = subprocess.run(cmd, check=False, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=limit)
        log(f"  agent run exit {p.returncode}; stderr tail: {p.stderr[-1500:]}")
        if child_json.exists():
            self.summary["agent_client"] = json.loads(child_json.read_text())
        rank = tmp / "captures" / "serving" / "rank0"
        if (rank / "trace.json.gz").exists():
            shutil.copy(rank / "trace.json.gz", self.out / "agent_trace.json.gz")
            self.summary["agent_trace_mb"] = round(os.path.getsize(self.out / "agent_trace.json.gz") / 1e6, 2)
        if (rank / "meta.json").exists():
            shutil.copy(rank / "meta.json", self.out / "agent_meta.json")
        shutil.rmtree(tmp, ignore_errors=True)

    def host_sampling(self) -> None:
        """HOST_SAMPLING's scenario: a decode loop that samples on the host, profiled, and its
        remedy (sampling on the GPU) timed without the profiler."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        cpu = self.args.cpu
        n = 8 if cpu else 48
        manual_decode(self.model, cpu, True, 4)
        host, gpu = [], []
        for _ in range(3):
            host.append(manual_decode(self.model, cpu, True, n))
            gpu.append(manual_decode(self.model, cpu, False, n))
        host_s, gpu_s = sorted(host)[1], sorted(gpu)[1]
        self.summary["host_sampling"] = {"host_s_per_token": host_s, "gpu_s_per_token": gpu_s,
                                         "measured_share": (host_s - gpu_s) / host_s if host_s > 0 else None}
        log(f"  host sampling {host_s * 1e3:.2f} ms/token, GPU sampling {gpu_s * 1e3:.2f} ms/token")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() and not cpu else [])
        path = self.out / "host_sampling_trace.json"
        with profile(activities=acts, record_shapes=True, with_stack=True) as p:
            manual_decode(self.model, cpu, True, 24 if not cpu else 6)
        p.export_chrome_trace(str(path))
        with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()

    def analyse(self, name: str) -> None:
        """aiprof's report of one trace, in a child process with a time limit (an ingest that runs
        long must not take the run past its budget), summarised into analysis.json."""
        trace = self.out / f"{name}_trace.json.gz"
        meta = self.out / "agent_meta.json" if name == "agent" else None
        client = {"raw": self.summary.get("profiled_client"), "agent": self.summary.get("agent_client")}.get(name)
        if not trace.exists():
            raise FileNotFoundError(trace)
        tmp = Path(tempfile.mkdtemp(prefix="aiprof-analysis-"))
        try:
            d = tmp / name / "rank0"
            d.mkdir(parents=True)
            shutil.copy(trace, d / "trace.json.gz")
            if meta is not None and meta.exists():
                shutil.copy(meta, d / "meta.json")
            env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       AIPROF_PROGRESS="never")
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "aiprof", "analyze", str(tmp / name), "--json"], check=False,
                               cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=max(10.0, self.left() - 5))
            if p.returncode != 0:
                raise RuntimeError(f"aiprof analyze exit {p.returncode}: {p.stderr[-800:]}")
            rep = json.loads(p.stdout)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        measured = dict(self.summary.get("unprofiled") or {}, host_sampling=self.summary.get("host_sampling"))
        res = summarize_report(rep, client, measured)
        res["analysis_s"] = round(time.perf_counter() - t, 1)
        log(f"  {name}: {json.dumps({k: v for k, v in res.items() if k != 'causes'})}")
        for c in res["causes"][:6]:
            log(f"    {c['code']} {c['severity']} share {c['share']:.3f} (predicted x{c['predicted_speedup']:.2f}, "
                f"measured {c['measured_speedup']}): {c['title']}")
        path = self.out / "analysis.json"
        allres = json.loads(path.read_text()) if path.exists() else {}
        allres[name] = res
        path.write_text(json.dumps(allres, indent=1, default=str))


def manual_decode(model, cpu: bool, host_sampling: bool, steps: int, batch: int = 8, prompt: int = 64) -> float:
    """A hand-written decode loop (dynamic KV cache): sampling on the host (logits copied to the CPU,
    softmax + argmax there) or on the GPU (only the token ids copied). Seconds per token."""
    import torch

    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).to(dev)
    past = None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :]
            if host_sampling:
                cpu_logits = logits.float().cpu()
                nxt = torch.argmax(torch.softmax(cpu_logits, dim=-1), dim=-1, keepdim=True).to(dev)
            else:
                nxt = torch.argmax(logits, dim=-1, keepdim=True)
                nxt.cpu()  # the ids the client needs
            ids = nxt
    sync()
    return (time.perf_counter() - t) / steps


def summarize_report(rep: dict, client: dict | None, unprofiled: dict) -> dict:
    """What the closing note needs: iterations and phases found vs the engine's, tokens/s vs the
    client's, the causes with predicted speed-ups vs the measured remedies."""
    r = rep["ranks"][0]
    sv = (r.get("serving") or {}).get("summary") or {}
    out = {"step_source": r["step_source"], "step_within": r.get("step_within", ""), "iterations": len(r["steps"]),
           "busy_iterations": sv.get("busy_iterations"),
           "phases": {p: v["iterations"] for p, v in (sv.get("by_phase") or {}).items()},
           "tokens_out": sv.get("tokens_out"), "tokens_per_s": sv.get("tokens_per_s"),
           "batch": sv.get("batch"), "inter_token_us": sv.get("inter_token_us"),
           "gpu_busy_pct": sv.get("gpu_busy_pct"), "host_overhead_pct": sv.get("host_overhead_pct")}
    if client:
        out["client_tokens_per_s"] = client.get("tokens_per_s")
        out["client_tokens"] = client.get("tokens")
        out["engine_steps"] = client.get("engine_steps")
        out["engine_phases"] = client.get("engine_phases")
        if client.get("tokens_per_s") and sv.get("tokens_per_s"):
            out["tokens_per_s_vs_client"] = sv["tokens_per_s"] / client["tokens_per_s"]
    hs = (unprofiled.get("host_sampling") or {}).get("measured_share")
    measured = {"DECODE_LAUNCH_BOUND": unprofiled.get("cuda_graphs_speedup"), "LAUNCH_BOUND": unprofiled.get("cuda_graphs_speedup"),
                "SMALL_BATCH": unprofiled.get("batch_x4_speedup"),
                "HOST_SAMPLING": 1.0 / (1.0 - hs) if hs is not None and hs < 1 else None}
    out["causes"] = []
    shares: dict[str, float] = {}
    for c in rep.get("causes", []):
        share = c["saving"].get("share", 0.0)
        shares.setdefault(c["code"], share)
        row = {"code": c["code"], "severity": c["severity"], "share": share,
               "per_step_us": c["saving"].get("per_step_us"), "title": c["title"],
               "predicted_speedup": 1.0 / max(1.0 - share, 1e-6),
               "measured_speedup": measured.get(c["code"]), "evidence": c.get("evidence")}
        k = (c.get("evidence") or {}).get("batch_factor")
        if c["code"] == "SMALL_BATCH" and k and k > 1:
            # the replay drops (1 - 1/k) of the decode iterations; the measured remedy has
            # BATCH_FACTOR x the requests: the same model at that factor
            f = min(BATCH_FACTOR, k)
            s_f = share * (1 - 1 / f) / (1 - 1 / k)
            row[f"predicted_speedup_at_x{BATCH_FACTOR}"] = 1.0 / max(1.0 - s_f, 1e-6)
        out["causes"].append(row)
    # CUDA graphs in continuous batching cover every forward: the decode cause and what the
    # generic launch cause prices after it
    g = shares.get("DECODE_LAUNCH_BOUND", 0.0) + shares.get("LAUNCH_BOUND", 0.0)
    out["cuda_graphs"] = {"predicted_share": g, "predicted_speedup": 1.0 / max(1.0 - g, 1e-6),
                          "measured_speedup": unprofiled.get("cuda_graphs_speedup")}
    return out


def child(args) -> None:
    """Under `aiprof run`: one long round (one engine thread: the agent starts and stops the
    profiler on the thread that runs the iterations, so the capture must not span two rounds)."""
    model = build_model(args.cpu)
    instrument_scheduler()
    r = run_client(model, workload(args.cpu, scale=4), args.cpu)
    Path(args.child).write_text(json.dumps({k: v for k, v in r.items() if k != "step_log"}, default=str))
    time.sleep(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="a tiny model on the CPU (checks the logic)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out/serving", help="output folder (default $OUT)")
    ap.add_argument("--rounds", type=int, default=3, help="unprofiled rounds of each configuration")
    ap.add_argument("--budget-s", type=float, default=230.0, help="stop starting phases after this (s)")
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    run = Runner(args)
    run.phase("setup", run.setup)
    if run.model is None:
        return 1
    # most important first: the client's numbers, the raw capture and its analysis
    run.phase("unprofiled_rounds", run.rounds, need_s=30)
    run.phase("raw_profile", run.raw_profile, need_s=40)
    run.phase("analysis_raw", lambda: run.analyse("raw"), need_s=20)
    run.phase("host_sampling", run.host_sampling, need_s=25)
    run.phase("analysis_host_sampling", lambda: run.analyse("host_sampling"), need_s=10)
    run.phase("agent", run.agent, need_s=70)
    run.phase("analysis_agent", lambda: run.analyse("agent"), need_s=15)
    big = {p.name: round(p.stat().st_size / 1e6, 1) for p in run.out.iterdir() if p.stat().st_size > 15e6}
    if big:
        run.summary["errors"]["size"] = f"files over 15 MB: {big}"
    run.write()
    log(f"done in {time.perf_counter() - run.t0:.0f} s; files: {sorted(p.name for p in run.out.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
