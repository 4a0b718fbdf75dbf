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


def mapped(s: pm.PmSamples, mark_ts: float, mark_unix: tuple[int, int]):
    """PM windows on the trace clock (µs) through the per-decode clock pairs, and the kept mask."""
    from aiprof.trace.pmclock import map_batches
    u0, u1, keep, mp = map_batches(s.t0, s.t1, s.batches, s.clock)
    off = mark_ts - (mark_unix[0] + mark_unix[1]) / 2000.0
    return u0 / 1000.0 + off, u1 / 1000.0 + off, keep, mp


def rates(metrics: list[str], values: np.ndarray, a, b) -> np.ndarray:
    """Counts per window -> per second (as agent/hwmon.write_pm_csv does)."""
    v = values.astype(np.float64).copy()
    w = np.maximum((b - a) * 1e-6, 1e-9)
    for j, m in enumerate(metrics):
        if pm.is_count(m):
            v[:, j] = v[:, j] * pm.SCALE.get(m, 1.0) / w
    return v


def phase_means(cols, vals, a, b, ks, pred) -> dict:
    """Time-weighted mean of every column over samples overlapping kernels matching pred."""
    sel = [k for k in ks if pred(k["name"])]
    if not sel:
        return {}
    w = np.zeros(len(a))
    for k in sel:
        lo, hi = k["ts"], k["ts"] + k["dur"]
        i0, i1 = np.searchsorted(b, lo), np.searchsorted(a, hi)
        for i in range(i0, i1):
            ov = min(b[i], hi) - max(a[i], lo)
            if ov > 0:
                w[i] += ov
    if w.sum() <= 0:
        return {"kernels": len(sel), "overlap_us": 0}
    return {"kernels": len(sel), "overlap_us": float(w.sum()),
            **{c: float((vals[:, j] * w).sum() / w.sum()) for j, c in enumerate(cols)}}


def outside_means(cols, vals, a, b, ks) -> dict:
    """Means over sample time not covered by any kernel (idle GPU)."""
    from aiprof.analysis.intervals import union
    st = np.array([k["ts"] for k in ks if k["cat"] == "kernel"])
    en = st + np.array([k["dur"] for k in ks if k["cat"] == "kernel"])
    u = union((st * 1000).astype(np.int64), (en * 1000).astype(np.int64))
    cov = u.covered((a * 1000).astype(np.int64), (b * 1000).astype(np.int64)) / 1000.0
    w = np.maximum((b - a) - cov, 0)
    if w.sum() <= 0:
        return {}
    return {"idle_us": float(w.sum()), **{c: float((vals[:, j] * w).sum() / w.sum()) for j, c in enumerate(cols)}}


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
    t = time.perf_counter()
    why: dict = {}
    chosen = pm.resolve_metrics(0, diagnose=why)
    R["resolve_s"] = round(time.perf_counter() - t, 3)
    R["rejected"] = why
    R["chosen"] = chosen
    t = time.perf_counter()
    R["resolve_cached"] = pm.resolve_metrics(0) == chosen
    R["resolve_cached_s"] = round(time.perf_counter() - t, 3)
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
    """Idle, elementwise and GEMM phases under PM sampling + Kineto (PM first, then the profiler,
    as the agent does): counters per phase, the alignment check, and the recorded test data."""
    from torch.profiler import ProfilerActivity, profile

    from aiprof.trace.pmclock import alignment_check
    big = torch.randn(256 << 20, device="cuda")  # 1 GiB fp32
    a16 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    samp = pm.PmSampler(0, 100, chosen)
    R["counter_data_bytes"] = int(lib.aps_counter_data_bytes())
    samp.start()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    mu = marker()
    for _ in range(3):
        time.sleep(0.01)
        for _ in range(20):
            big.mul_(1.0001)  # elementwise: reads and writes 1 GiB, DRAM-bound
        torch.cuda.synchronize()
        time.sleep(0.01)
        for _ in range(10):
            torch.mm(a16, b16)  # bf16 GEMM: tensor cores
        torch.cuda.synchronize()
    time.sleep(0.01)
    prof.stop()
    s = samp.stop()
    ks, mark_ts = kineto_kernels(prof, "/tmp/phase_trace.json")
    R["phase"] = {"raw_gaps": gaps(s), "stats": s.stats, "clock": s.clock, "batches": len(s.batches),
                  "kernels": len(ks), "marker_ts": mark_ts}
    a, b, keep, mp = mapped(s, mark_ts, mu)
    R["phase"]["mapping"] = mp.__dict__
    a, b = a[keep], b[keep]
    v = rates(s.metrics, s.values[keep], a, b)
    d = np.diff(a)
    R["phase"]["gap_us"] = {"median": float(np.median(d)), "p99": float(np.percentile(d, 99)), "max": float(d.max())}
    low = lambda n: n.lower()  # noqa: E731
    R["phase"]["gemm"] = phase_means(s.columns, v, a, b, ks, lambda n: "gemm" in low(n) or "nvjet" in low(n))
    R["phase"]["elementwise"] = phase_means(s.columns, v, a, b, ks, lambda n: "elementwise" in low(n))
    R["phase"]["idle"] = outside_means(s.columns, v, a, b, ks)
    kk = [k for k in ks if k["cat"] == "kernel"]
    if "pm_sm_active_pct" in s.columns:
        chk = alignment_check(a, b, v[:, s.columns.index("pm_sm_active_pct")], np.array([k["ts"] for k in kk]),
                              np.array([k["ts"] + k["dur"] for k in kk]))
        R["phase"]["alignment"] = chk.__dict__
    data = {"columns": s.columns, "metrics": s.metrics, "clock": s.clock, "batches": s.batches,
            "marker_unix_ns": list(mu), "marker_ts_us": mark_ts, "interval_us": 100, "chip": s.stats.get("chip"),
            "device_name": R["device"], "t0": [int(x) for x in s.t0], "t1": [int(x) for x in s.t1],
            "values": [[float(f"{x:.6g}") for x in row] for row in s.values.tolist()], "kernels": kk}
    with gzip.open(os.path.join(OUT, "pm_phases_h100.json.gz"), "wt") as f:
        json.dump(data, f)
    del big, a16, b16
    torch.cuda.empty_cache()


def gpt2(chosen: dict) -> None:
    """Step time of GPT-2 training: none / PM sampler / Kineto / Kineto + PM, interleaved."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, T = 8, 1024

    def step() -> float:
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

    for _ in range(8):
        step()
    N = int(os.environ.get("PROBE_STEPS", "10"))
    ROUNDS = int(os.environ.get("PROBE_ROUNDS", "5"))
    modes = ["none", "pm", "kineto", "kineto+pm"]
    res: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(ROUNDS):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order against drift
            samp = prof = None
            if "pm" in mode:
                samp = pm.PmSampler(0, 100, chosen)
                try:
                    samp.start()
                except pm.PmUnavailable as exc:  # keep the rounds measured so far
                    R.setdefault("gpt2_start_errors", []).append({"round": r, "mode": mode, "error": str(exc)})
                    save()
                    continue
            if "kineto" in mode:
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.start()
            ts = [step() for _ in range(N)]
            s = samp.stop() if samp is not None else None  # before the profiler's teardown, as the agent does
            if prof is not None:
                prof.stop()
                del prof
            res[mode].append(statistics.median(ts))
            if s is not None:
                R.setdefault("gpt2_pm_runs", []).append({"mode": mode, "rows": int(len(s.t0)), "stats": s.stats})
    res = {m: v for m, v in res.items() if v}
    base = statistics.median(res["none"])
    kin = statistics.median(res["kineto"])
    R["gpt2"] = {"median_step_ms": {m: round(statistics.median(v) * 1e3, 3) for m, v in res.items()},
                 "per_round_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in res.items()},
                 "ratio_vs_none": {m: round(statistics.median(v) / base, 4) for m, v in res.items()},
                 "kineto+pm_vs_kineto": round(statistics.median(res["kineto+pm"]) / kin, 4) if "kineto+pm" in res else None,
                 "steps": N, "rounds": ROUNDS}


if __name__ == "__main__":
    try:
        main()
    except Exception:
        R["errors"].append(traceback.format_exc()[-3000:])
        save()
        raise
    finally:
        save()
        print(json.dumps(R, indent=1, default=str)[:6000])
