"""Probe CUPTI PM sampling on the GPU machine: metrics, coexistence with Kineto, clock mapping.

Writes to $OUT: metrics.txt (every base metric the PM sampler offers), probe.json (what ran,
the chosen metrics, per-phase counter means, sample gaps, clock mapping checks) and
pm_gpt2.json.gz (a short window of real samples + the Kineto kernels of the same window: the
CPU tests' recorded data).

    python bench/pm_probe.py            # needs a CUDA GPU
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from aiprof.agent import pmsampling as pm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
R: dict = {"errors": []}
MARK = "aiprof::clock_sync"


def save() -> None:
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(R, f, indent=1, default=str)


def kineto_kernels(prof, path: str) -> tuple[list[dict], float | None]:
    prof.export_chrome_trace(path)
    with open(path) as f:
        tr = json.load(f)
    ks, mark = [], None
    for e in tr.get("traceEvents", []):
        if e.get("name") == MARK and mark is None:
            mark = float(e["ts"])
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            ks.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]), "cat": e["cat"]})
    os.unlink(path)
    return ks, mark


def marker() -> tuple[int, int]:
    from torch.autograd.profiler import record_function
    t0 = time.time_ns()
    with record_function(MARK):
        t1 = time.time_ns()
    return t0, t1


def gaps(s: pm.PmSamples) -> dict:
    t0 = s.t0.astype(np.int64)
    d = np.diff(t0) / 1000.0
    if len(d) == 0:
        return {"n": int(len(t0))}
    return {"n": int(len(t0)), "median_us": float(np.median(d)), "p99_us": float(np.percentile(d, 99)),
            "max_us": float(d.max()), "min_us": float(d.min()),
            "width_median_us": float(np.median((s.t1.astype(np.int64) - t0) / 1000.0))}


def to_trace_us(s: pm.PmSamples, mark_ts: float, mark_unix: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """PM times -> trace µs, assuming PM timestamps are on cuptiGetTimestamp's clock."""
    c = s.clock[0]
    cupti_minus_unix = c["cupti_ns"] - c["unix_ns"]
    trace_minus_unix_us = mark_ts - (mark_unix[0] + mark_unix[1]) / 2000.0
    a = (s.t0.astype(np.int64) - cupti_minus_unix) / 1000.0 + trace_minus_unix_us
    b = (s.t1.astype(np.int64) - cupti_minus_unix) / 1000.0 + trace_minus_unix_us
    return a, b


def phase_means(s, a, b, ks, pred) -> dict:
    """Time-weighted mean of every column over samples overlapping kernels matching pred."""
    sel = [k for k in ks if pred(k["name"])]
    if not sel:
        return {}
    w = np.zeros(len(a))
    mid = (a + b) / 2
    for k in sel:
        lo, hi = k["ts"], k["ts"] + k["dur"]
        i0, i1 = np.searchsorted(b, lo), np.searchsorted(a, hi)
        for i in range(i0, i1):
            ov = min(b[i], hi) - max(a[i], lo)
            if ov > 0:
                w[i] += ov
    if w.sum() <= 0:
        return {"kernels": len(sel), "overlap_us": 0}
    del mid
    return {"kernels": len(sel), "overlap_us": float(w.sum()),
            **{c: float((s.values[:, j] * w).sum() / w.sum()) for j, c in enumerate(s.columns)}}


def busy_lag(s, a, b, ks, col: str) -> dict:
    """Cross-correlate the column with kernel-busy fraction per sample; best lag in µs."""
    if col not in s.columns or len(a) < 10:
        return {}
    j = s.columns.index(col)
    step = float(np.median(np.diff(a)))
    grid = np.arange(a[0], b[-1], step / 4)
    busy = np.zeros(len(grid))
    for k in ks:
        if k["cat"] != "kernel":
            continue
        i0, i1 = np.searchsorted(grid, k["ts"]), np.searchsorted(grid, k["ts"] + k["dur"])
        busy[i0:i1] = 1.0
    val = np.interp(grid, (a + b) / 2, s.values[:, j])
    best = None
    for lag_i in range(-400, 401):
        sh = np.roll(val, lag_i)
        c = np.corrcoef(sh[450:-450], busy[450:-450])[0, 1]
        if best is None or c > best[1]:
            best = (lag_i, c)
    return {"lag_us": best[0] * step / 4, "corr": float(best[1]), "grid_us": step / 4}


def main() -> None:
    R["torch"] = torch.__version__
    R["device"] = torch.cuda.get_device_name(0)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    try:
        lib = pm._load()
    except Exception as exc:
        R["errors"].append(f"load: {exc}")
        save()
        raise
    R["build_load_s"] = round(time.perf_counter() - t, 3)
    R["cupti"] = lib.cupti_path
    R["cupti_loaded_before"] = pm.loaded_libcupti()
    ms = pm.list_metrics(0)
    with open(os.path.join(OUT, "metrics.txt"), "w") as f:
        f.write("\n".join(f"{t}\t{n}" for t, n in ms))
    R["n_base_metrics"] = len(ms)
    interesting = [n for _, n in ms if any(k in n for k in ("tensor", "dram", "nvl", "pcie", "lts__t_", "sm__cycles",
                                                            "inst_executed", "warps_active", "gpc__cycles"))]
    R["interesting"] = interesting[:200]
    t = time.perf_counter()
    chosen = pm.resolve_metrics(0)
    R["resolve_s"] = round(time.perf_counter() - t, 3)
    R["chosen"] = chosen
    R["missing_roles"] = [c for c, _, _ in pm.ROLES if c not in chosen]
    save()

    try:
        phases(lib, chosen)
    except Exception:
        R["errors"].append("phases: " + traceback.format_exc()[-2000:])
    save()
    # 2) GPT-2 training: overhead none / pm / kineto / kineto+pm, interleaved; one window recorded
    try:
        gpt2(chosen)
    except Exception:
        R["errors"].append("gpt2: " + traceback.format_exc()[-2000:])
    save()


def phases(lib, chosen: dict) -> None:
    """Idle, elementwise and GEMM phases under PM sampling + Kineto (PM first, then the profiler)."""
    from torch.profiler import ProfilerActivity, profile
    big = torch.randn(256 << 20, device="cuda")  # 1 GiB fp32
    a16 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    samp = pm.PmSampler(0, 100, chosen)
    R["counter_data_bytes"] = int(lib.aps_counter_data_bytes())
    samp.start()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    mu = marker()
    for _ in range(3):
        torch.cuda._sleep(20_000_000)  # ~10 ms of an idle-ish spin kernel
        for _ in range(20):
            big.mul_(1.0001)
        torch.cuda.synchronize()
        time.sleep(0.01)
        for _ in range(10):
            torch.mm(a16, b16)
        torch.cuda.synchronize()
        time.sleep(0.01)
    prof.stop()
    s = samp.stop()
    ks, mark_ts = kineto_kernels(prof, "/tmp/phase_trace.json")
    R["phase"] = {"gaps": gaps(s), "stats": s.stats, "clock": s.clock, "kernels": len(ks), "marker_ts": mark_ts}
    if mark_ts is not None and len(s.t0):
        a, b = to_trace_us(s, mark_ts, mu)
        R["phase"]["gemm"] = phase_means(s, a, b, ks, lambda n: "gemm" in n.lower() or "nvjet" in n.lower()
                                         or "sm90" in n.lower())
        R["phase"]["elementwise"] = phase_means(s, a, b, ks, lambda n: "elementwise" in n.lower() or "vectorized" in n.lower())
        R["phase"]["all_kernels"] = phase_means(s, a, b, ks, lambda n: True)
        R["phase"]["lag_sm_active"] = busy_lag(s, a, b, ks, "pm_sm_active_pct")
        # last sample end vs CUPTI now at stop: same domain if small and positive
        R["phase"]["stop_minus_last_t1_us"] = (s.clock[-1]["cupti_ns"] - int(s.t1[-1])) / 1000.0
        R["phase"]["first_t0_minus_start_us"] = (int(s.t0[0]) - s.clock[0]["cupti_ns"]) / 1000.0
    del big, a16, b16


def gpt2(chosen: dict) -> None:
    from torch.profiler import ProfilerActivity, profile
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, T = 8, 1024

    def step(i: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        xb = torch.randint(0, 50257, (B, T)).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(xb, labels=xb)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for i in range(8):
        step(i)
    N = int(os.environ.get("PROBE_STEPS", "12"))
    ROUNDS = int(os.environ.get("PROBE_ROUNDS", "3"))
    res: dict[str, list[float]] = {"none": [], "pm": [], "kineto": [], "kineto+pm": []}
    keep = None
    for r in range(ROUNDS):
        for mode in list(res):
            samp = prof = None
            if "pm" in mode:
                samp = pm.PmSampler(0, 100, chosen)
                samp.start()
            if "kineto" in mode:
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.start()
                mu = marker()
            ts = [step(i) for i in range(N)]
            if prof is not None:
                prof.stop()
            s = samp.stop() if samp is not None else None
            res[mode].append(statistics.median(ts))
            if mode == "kineto+pm" and r == ROUNDS - 1 and s is not None:
                ks, mark_ts = kineto_kernels(prof, "/tmp/gpt_trace.json")
                keep = (s, ks, mark_ts, mu)
            elif mode == "pm" and s is not None:
                R.setdefault("gpt2_pm_only", []).append({"gaps": gaps(s), "stats": s.stats})
    base = statistics.median(res["none"])
    R["gpt2"] = {"median_step_ms": {m: round(statistics.median(v) * 1e3, 3) for m, v in res.items()},
                 "per_round_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in res.items()},
                 "ratio_vs_none": {m: round(statistics.median(v) / base, 4) for m, v in res.items()},
                 "steps": N, "rounds": ROUNDS}
    kin = statistics.median(res["kineto"])
    R["gpt2"]["kineto+pm_vs_kineto"] = round(statistics.median(res["kineto+pm"]) / kin, 4)
    if keep is None:
        return
    s, ks, mark_ts, mu = keep
    R["gpt2"]["gaps"] = gaps(s)
    R["gpt2"]["stats"] = s.stats
    a, b = to_trace_us(s, mark_ts, mu)
    low = lambda n: n.lower()  # noqa: E731
    R["gpt2"]["gemm"] = phase_means(s, a, b, ks, lambda n: any(k in low(n) for k in ("gemm", "nvjet", "sm90_xmma", "cutlass")))
    R["gpt2"]["elementwise"] = phase_means(s, a, b, ks, lambda n: "elementwise" in low(n) or "vectorized" in low(n))
    R["gpt2"]["flash"] = phase_means(s, a, b, ks, lambda n: "flash" in low(n) or "fmha" in low(n))
    R["gpt2"]["lag_sm_active"] = busy_lag(s, a, b, ks, "pm_sm_active_pct")
    names: dict[str, int] = {}
    for k in ks:
        names[k["name"][:80]] = names.get(k["name"][:80], 0) + 1
    R["gpt2"]["top_kernels"] = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    # recorded data for the CPU tests: ~2 steps' window in the middle, raw CUPTI times
    mid = len(s.t0) // 2
    span = int(0.2e9 / max(1, np.median(np.diff(s.t0.astype(np.int64)))))
    lo, hi = max(0, mid - span // 2), min(len(s.t0), mid + span // 2)
    w0 = a[lo] if lo < len(a) else 0
    w1 = b[hi - 1] if hi > lo else 0
    data = {"columns": s.columns, "metrics": s.metrics, "clock": s.clock, "marker_unix_ns": list(mu),
            "marker_ts_us": mark_ts, "interval_us": 100, "chip": s.stats.get("chip"), "device_name": R["device"],
            "t0": [int(v) for v in s.t0[lo:hi]], "t1": [int(v) for v in s.t1[lo:hi]],
            "values": [[round(float(v), 4) for v in row] for row in s.values[lo:hi]],
            "kernels": [k for k in ks if k["ts"] + k["dur"] >= w0 and k["ts"] <= w1]}
    with gzip.open(os.path.join(OUT, "pm_gpt2.json.gz"), "wt") as f:
        json.dump(data, f)
    np.savez_compressed(os.path.join(OUT, "pm_gpt2_full.npz"), t0=s.t0, t1=s.t1, values=s.values,
                        columns=np.array(s.columns))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        R["errors"].append(traceback.format_exc()[-3000:])
        save()
        raise
    finally:
        save()
        print(json.dumps({k: v for k, v in R.items() if k not in ("interesting",)}, indent=1, default=str)[:9000])
