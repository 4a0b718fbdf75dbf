"""Hardware sampler: a daemon thread that samples GPU (NVML, GPM), host and InfiniBand counters.

Runs only during a capture. Every sample is ``(unix_ns, device, metric, value)``; the capture
driver shifts the times onto the trace clock when it writes ``hw.csv`` (long format, one value
per row; docs/capture.md lists every metric and its unit).

Sources, each skipped quietly when missing (no GPU in CI, no psutil, no /sys/class/infiniband):
- NVML (nvidia-ml-py): utilisation, SM clock, power, memory used every tick; NVLink byte
  counters as rates; PCIe throughput only where GPM is not there (that query blocks ~20 ms).
- GPM (Hopper+): SM util, occupancy, tensor util, DRAM bandwidth, PCIe and NVLink rates over a
  window of at least 100 ms (shorter windows read as zeros on H200).
- psutil: system CPU %, this process's CPU %, system memory used, process RSS.
- /sys/class/infiniband/*/ports/*/counters: port_{xmit,rcv}_data as bytes/s.
- CUPTI PM sampling (agent/pmsampling.py), when asked for (``pm_interval_us``): the GPU's own
  performance monitors every ~100 µs, read by a sampler process of the capture's own
  (agent/pmsidecar.py) whose C thread decodes them into a bounded buffer. Where it
  cannot run (no GPU, no permission, old driver, MIG...) ``pm_status`` says why and the GPU
  counters above (NVML/GPM) are what the capture has.
"""
from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from aiprof.agent import log

Sample = tuple[int, str, str, float]
MAX_SAMPLES = 200_000
#: Failures of a capture's PM sampler that the next capture of the process would meet again:
#: counters restricted to administrators (NVreg_RestrictProfilingToAdminUsers), a GPU or mode
#: without PM sampling (pre-Turing, MIG, vGPU), no driver or no device (CUresult 100), no
#: headers. The agent then skips PM in its later captures (saying why) instead of starting a
#: sampler process each time to fail the same way. Read only in the sampler's own error answer.
PM_LASTING_FAILURES = re.compile(r"\bCUPTI_ERROR_(INSUFFICIENT_PRIVILEGES|NOT_SUPPORTED|LEGACY_PROFILER_NOT_SUPPORTED)\b"
                                 r"|^no CUDA driver \(|^cuInit failed \(CUresult 100\)"
                                 r"|^CUPTI headers with|^libcupti not found|^cuda\.h not found")


def pm_failure_lasts(msg: str) -> bool:
    """Whether a PM sampler's own failure answer (its one-line reason) would repeat in every capture."""
    return bool(PM_LASTING_FAILURES.search(msg))
GPM_MIN_WINDOW_S = 0.1

# GPM metric id name -> our column name (ids resolved lazily from pynvml)
_GPM_METRICS = {
    "NVML_GPM_METRIC_SM_UTIL": "gpm_sm_util_pct",
    "NVML_GPM_METRIC_SM_OCCUPANCY": "gpm_sm_occupancy_pct",
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": "gpm_tensor_util_pct",
    "NVML_GPM_METRIC_DRAM_BW_UTIL": "gpm_dram_bw_util_pct",
    "NVML_GPM_METRIC_GRAPHICS_UTIL": "gpm_graphics_util_pct",
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": "gpm_pcie_tx_MBps",
    "NVML_GPM_METRIC_PCIE_RX_PER_SEC": "gpm_pcie_rx_MBps",
    "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC": "gpm_nvlink_tx_MBps",
    "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC": "gpm_nvlink_rx_MBps",
}


class _Gpu:
    """NVML state for one GPU."""

    def __init__(self, nvml: Any, handle: Any, label: str) -> None:
        self.N = nvml
        self.h = handle
        self.label = label
        self.gpm_ids: list[tuple[int, str]] = []
        self.gpm_prev: Any = None
        self.gpm_prev_t = 0.0
        self.gpm_spare: Any = None
        self.nvlink_prev: tuple[float, float, float] | None = None
        self.broken: set[str] = set()
        try:
            if nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                for name, col in _GPM_METRICS.items():
                    mid = getattr(nvml, name, None)
                    if mid is not None:
                        self.gpm_ids.append((mid, col))
                self.gpm_prev = nvml.nvmlGpmSampleAlloc()
                self.gpm_spare = nvml.nvmlGpmSampleAlloc()
                nvml.nvmlGpmSampleGet(handle, self.gpm_prev)
                self.gpm_prev_t = time.perf_counter()
        except Exception:
            self.gpm_ids = []

    def _try(self, name: str, fn: Any) -> Any:
        if name in self.broken:
            return None
        try:
            return fn()
        except Exception:
            self.broken.add(name)  # not supported on this GPU/driver: stop asking
            return None

    def sample(self, out: list[Sample], t_ns: int, pm_running: bool = False) -> None:
        """One reading of every NVML source; none while ``pm_running`` (CUPTI PM sampling this GPU).

        PM measures SM activity, clocks, DRAM, NVLink and PCIe every 100 µs, 1,000x finer than
        these reads, and NVML polled from the job's process while a sampler process runs PM made
        GPT-2 steps under kernel tracing ×1.050 longer (median of 11 paired rounds on H100s, 9
        above ×1.01), the GPU's kernel time unchanged (65.6-66.2 ms a step): the host was slowed,
        not the GPU. With NVML read only before and after the PM session, ×1.004 (10 rounds, 3
        above ×1.01; bench/pm_overhead.py, docs/capture.md "What it costs"). So the capture's
        first and last samples keep power and memory, PM covers the time between, and readers
        of hw.csv see that stretch as unsampled (timeseries.with_gaps, rankdiff.sm_clock_mhz)."""
        if pm_running:
            return
        N, h, d = self.N, self.h, self.label
        u = self._try("util", lambda: N.nvmlDeviceGetUtilizationRates(h))
        if u is not None:
            out.append((t_ns, d, "gpu_util_pct", float(u.gpu)))
            out.append((t_ns, d, "mem_util_pct", float(u.memory)))
        v = self._try("clock", lambda: N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM))
        if v is not None:
            out.append((t_ns, d, "sm_clock_mhz", float(v)))
        v = self._try("power", lambda: N.nvmlDeviceGetPowerUsage(h))
        if v is not None:
            out.append((t_ns, d, "power_w", v / 1000.0))
        m = self._try("mem", lambda: N.nvmlDeviceGetMemoryInfo(h))
        if m is not None:
            out.append((t_ns, d, "mem_used_bytes", float(m.used)))
        self._nvlink(out, t_ns)
        if self.gpm_ids:
            self._gpm(out, t_ns)
        else:
            for key, col in (("NVML_PCIE_UTIL_TX_BYTES", "pcie_tx_MBps"), ("NVML_PCIE_UTIL_RX_BYTES", "pcie_rx_MBps")):
                v = self._try(col, lambda key=key: N.nvmlDeviceGetPcieThroughput(h, getattr(N, key)))
                if v is not None:
                    out.append((t_ns, d, col, v / 1000.0))  # NVML gives KB/s

    def _nvlink(self, out: list[Sample], t_ns: int) -> None:
        N = self.N
        ids = [getattr(N, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", None), getattr(N, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", None)]
        if None in ids or "nvlink" in self.broken:
            return
        try:
            vals = N.nvmlDeviceGetFieldValues(self.h, ids)
            if any(v.nvmlReturn != 0 for v in vals):
                self.broken.add("nvlink")
                return
            tx, rx = float(vals[0].value.ullVal), float(vals[1].value.ullVal)  # KiB, cumulative
        except Exception:
            self.broken.add("nvlink")
            return
        now = time.perf_counter()
        if self.nvlink_prev is not None:
            t0, tx0, rx0 = self.nvlink_prev
            dt = now - t0
            if dt > 0:
                out.append((t_ns, self.label, "nvlink_tx_MBps", (tx - tx0) * 1024 / 1e6 / dt))
                out.append((t_ns, self.label, "nvlink_rx_MBps", (rx - rx0) * 1024 / 1e6 / dt))
        self.nvlink_prev = (now, tx, rx)

    def _gpm(self, out: list[Sample], t_ns: int) -> None:
        N = self.N
        now = time.perf_counter()
        if now - self.gpm_prev_t < GPM_MIN_WINDOW_S:
            return
        try:
            N.nvmlGpmSampleGet(self.h, self.gpm_spare)
            mg = N.c_nvmlGpmMetricsGet_t()
            mg.version = N.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(self.gpm_ids)
            mg.sample1 = self.gpm_prev
            mg.sample2 = self.gpm_spare
            for i, (mid, _) in enumerate(self.gpm_ids):
                mg.metrics[i].metricId = mid
            N.nvmlGpmMetricsGet(mg)
            for i, (_, col) in enumerate(self.gpm_ids):
                if mg.metrics[i].nvmlReturn == 0:
                    out.append((t_ns, self.label, col, float(mg.metrics[i].value)))
            self.gpm_prev, self.gpm_spare = self.gpm_spare, self.gpm_prev
            self.gpm_prev_t = now
        except Exception as exc:
            log.error("GPM sampling", exc)
            self.gpm_ids = []

    def close(self) -> None:
        for s in (self.gpm_prev, self.gpm_spare):
            if s is not None:
                try:
                    self.N.nvmlGpmSampleFree(s)
                except Exception:
                    pass


def _ib_ports() -> list[tuple[str, str]]:
    """(label, counters dir) of every InfiniBand/RoCE port, [] when there is none."""
    base = "/sys/class/infiniband"
    out: list[tuple[str, str]] = []
    try:
        for dev in sorted(os.listdir(base)):
            ports = os.path.join(base, dev, "ports")
            for port in sorted(os.listdir(ports)):
                cdir = os.path.join(ports, port, "counters")
                if os.path.exists(os.path.join(cdir, "port_xmit_data")):
                    out.append((f"ib:{dev}:{port}", cdir))
    except OSError:
        pass
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


#: A PM sampler process starts sampling only once torch.profiler has set CUPTI up in the job
#: (prepare_trace), so that the first recorded step is sampled and the sampler's start never
#: overlaps Kineto's own; bounded, for a profiler that never comes.
PROFILER_READY_WAIT_S = 30.0
#: A capture that ends before its sampler runs waits this long at most (on the training thread)
#: for the set-up thread to record why: it only has to see its killed child's pipe close.
PM_CANCEL_WAIT_S = 2.0


class HwSampler:
    """Samples until :meth:`stop`; samples are kept in memory (bounded) and returned by stop."""

    def __init__(self, interval_ms: int = 100, gpu_uuids: list[str] | None = None,
                 pm_interval_us: int = 0, cuda_index: int | None = None, pm_not_run: str | None = None,
                 pm_metrics: dict[str, str] | None = None) -> None:
        self.interval = max(0.01, interval_ms / 1000.0)
        self.gpu_uuids = gpu_uuids or []
        self.samples: list[Sample] = []
        self.sources: list[str] = []
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpus: list[_Gpu] = []
        self._nvml: Any = None
        self._proc: Any = None
        self._psutil: Any = None
        self._ib: list[tuple[str, str]] = []
        self._ib_prev: dict[str, tuple[float, int, int]] = {}
        self.pm_interval_us = pm_interval_us
        self.cuda_index = cuda_index
        self.pm_metrics = pm_metrics  # what the agent's prewarm resolved (None: the sampler resolves them)
        self.pm: Any = None  # the running sampler process (pmsidecar.PmSidecar)
        self.pm_samples: Any = None  # PmSamples once stopped
        self.pm_status: dict[str, Any] = {"asked": bool(pm_interval_us or pm_not_run), "ok": False}
        if pm_not_run:  # asked for, but the capture driver did not let it set up (capture.PM_READY_MAX_S)
            self.pm_status["error"] = pm_not_run
            self.notes.append(f"CUPTI PM sampling not run: {pm_not_run}; GPU counters come from NVML/GPM only")
        self._pm_lock = threading.Lock()
        self._pm_ready = threading.Event()
        self._pm_cancel = False
        self._pm_pending: Any = None  # the sampler process while it sets up (stop_pm kills it)
        self.profiler_ready = threading.Event()  # set by the capture driver after prepare_trace

    def _setup_pm(self) -> None:
        """Start the capture's PM sampler process (agent/pmsidecar.py), and its sampling once the
        profiler is prepared (its CUPTI set-up never overlaps the job's). Runs on a thread of its
        own; never raises."""
        if not self.pm_interval_us:
            return
        t0 = time.perf_counter()
        if self.cuda_index is None:  # a CPU job: the note "no CUDA device in use" already says it
            self.pm_status["error"] = "no CUDA device in use"
            self._pm_ready.set()
            return
        side = None
        try:
            from aiprof.agent.pmsidecar import PmSidecar

            with self._pm_lock:
                if self._pm_cancel or self._stop.is_set():
                    raise RuntimeError("the capture ended before the PM sampler process started")
                side = self._pm_pending = PmSidecar(self.gpu_uuids[0] if self.gpu_uuids else None,
                                                    self.cuda_index, self.pm_interval_us, metrics=self.pm_metrics)
            side.wait_ready()  # the process and the driver: no CUPTI yet
            self.profiler_ready.wait(PROFILER_READY_WAIT_S)
            if self._pm_cancel:
                raise RuntimeError("cancelled")
            side.start()  # CUPTI, configuration, sampling; stop_pm kills it meanwhile if the capture ends
            with self._pm_lock:
                self._pm_pending = None
                if self._pm_cancel:
                    raise RuntimeError("cancelled")
                self.pm = side
            self.pm_status.update({"ok": True, "columns": side.columns, "metrics": side.metrics, "chip": side.chip,
                                   "setup_ms": round((time.perf_counter() - t0) * 1e3, 1),
                                   "setup_parts_ms": side.timing_ms, "sampler_pid": side.pid,
                                   "started_unix_ns": time.time_ns()})
            self.sources.append("cupti-pm")
        except Exception as exc:
            if side is not None:
                side.kill()
                side.close()
            with self._pm_lock:
                self._pm_pending = None
                cancelled = self._pm_cancel
            if cancelled:
                msg = (f"the capture ended before PM sampling was set up "
                       f"({(time.perf_counter() - t0) * 1e3:.0f} ms)")
                self.notes.append(f"CUPTI PM sampling: {msg}; GPU counters come from NVML/GPM only")
            else:
                msg = str(exc) if type(exc).__name__ == "SidecarError" else f"{type(exc).__name__}: {exc}"
                self.notes.append(f"CUPTI PM sampling unavailable ({msg}); GPU counters come from NVML/GPM only, "
                                  f"at {self.interval * 1e3:.0f} ms (GPM windows >= {GPM_MIN_WINDOW_S * 1e3:.0f} ms)")
            self.pm_status["error"] = msg
            if not cancelled and getattr(exc, "reported", False) and pm_failure_lasts(msg):
                self.pm_status["lasting"] = True
        finally:
            self._pm_ready.set()

    def pm_settled(self) -> bool:
        """PM sampling runs, or its set-up is over without it (failed, cancelled): the recording
        may start. True at once when PM sampling was not asked for."""
        return not self.pm_interval_us or self._pm_ready.is_set()

    def stop_pm(self) -> None:
        """Stop PM sampling now and take its rows; a sampler process still setting up is killed.
        Either way its process has exited when this returns, so that its CUPTI is gone before the
        job's profiler stops. Never raises."""
        try:
            if not self.pm_interval_us:
                return
            with self._pm_lock:
                self._pm_cancel = True
                pm, self.pm = self.pm, None
                pending, self._pm_pending = self._pm_pending, None
            self.profiler_ready.set()  # release a set-up still waiting for the profiler
            if pending is not None:
                pending.kill()  # (and reaped: KILL_WAIT_S at most)
            if pm is None:  # the set-up thread, released or its child killed, says why at once
                self._pm_ready.wait(PM_CANCEL_WAIT_S)
                return
            t0 = time.perf_counter()
            self.pm_samples = pm.stop()
            self.pm_status["stop_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        except Exception as exc:
            self.pm_status["ok"] = False
            self.pm_status["error"] = f"stop: {type(exc).__name__}: {exc}"
            self.notes.append(f"CUPTI PM sampling failed at stop ({exc}); its samples are lost")

    def _setup(self) -> None:
        try:
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process()
            psutil.cpu_percent(None)  # first call primes the counters
            self._proc.cpu_percent(None)
            self.sources.append("psutil")
        except Exception as exc:
            self.notes.append(f"host CPU/memory not sampled: {type(exc).__name__}: {exc}")
        if self.gpu_uuids:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                for i, uuid in enumerate(self.gpu_uuids):
                    h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                    self._gpus.append(_Gpu(pynvml, h, f"gpu{pynvml.nvmlDeviceGetIndex(h)}"))
                self.sources.append("nvml")
                if any(g.gpm_ids for g in self._gpus):
                    self.sources.append("gpm")
            except Exception as exc:
                self.notes.append(f"NVML not sampled: {type(exc).__name__}: {exc}")
        else:
            self.notes.append("no CUDA device in use: GPU counters not sampled")
        self._ib = _ib_ports()
        if self._ib:
            self.sources.append("infiniband")

    def start(self) -> None:
        """Start the sampling thread (returns at once)."""
        self._thread = threading.Thread(target=self._run, name="aiprof-hwmon", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> list[Sample]:
        """Stop sampling, wait (bounded) for the thread, and return the samples."""
        self.stop_pm()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.samples

    def _run(self) -> None:
        try:
            # PM sampling sets up on a thread of its own: it waits for the profiler (bounded)
            threading.Thread(target=self._setup_pm, name="aiprof-pm-setup", daemon=True).start()
            self._setup()
            next_t = time.perf_counter()
            while not self._stop.is_set() and len(self.samples) < MAX_SAMPLES:
                self.sample_once()
                next_t += self.interval
                delay = next_t - time.perf_counter()
                if delay < 0:  # fell behind (slow NVML call): don't try to catch up
                    next_t = time.perf_counter()
                    delay = 0.0
                self._stop.wait(delay)
            self.sample_once()
        except Exception as exc:
            log.error("hardware sampler", exc)
        finally:
            for g in self._gpus:
                g.close()
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    pass

    def sample_once(self) -> None:
        """Take one sample of every source into ``self.samples``."""
        t_ns = time.time_ns()
        out = self.samples
        ps = self._psutil
        if ps is not None:
            try:
                out.append((t_ns, "host", "cpu_util_pct", float(ps.cpu_percent(None))))
                out.append((t_ns, "host", "proc_cpu_pct", float(self._proc.cpu_percent(None))))
                vm = ps.virtual_memory()
                out.append((t_ns, "host", "mem_used_bytes", float(vm.total - vm.available)))
                out.append((t_ns, "host", "proc_rss_bytes", float(self._proc.memory_info().rss)))
            except Exception as exc:
                log.error("host sampling", exc)
                self._psutil = None
        pm_running = self.pm is not None
        for g in self._gpus:
            g.sample(out, t_ns, pm_running)
        now = time.perf_counter()
        for label, cdir in self._ib:
            tx = _read_int(os.path.join(cdir, "port_xmit_data"))
            rx = _read_int(os.path.join(cdir, "port_rcv_data"))
            if tx is None or rx is None:
                continue
            prev = self._ib_prev.get(label)
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                # port_*_data counts 4-byte words
                out.append((t_ns, label, "ib_tx_MBps", (tx - prev[1]) * 4 / 1e6 / dt))
                out.append((t_ns, label, "ib_rx_MBps", (rx - prev[2]) * 4 / 1e6 / dt))
            self._ib_prev[label] = (now, tx, rx)


def write_csv(path: str, samples: list[Sample], offset_us: float) -> int:
    """Write samples as ``ts_us,device,metric,value`` with ts on the trace clock; returns rows."""
    with open(path, "w") as f:
        f.write("ts_us,device,metric,value\n")
        for t_ns, dev, metric, value in samples:
            f.write(f"{t_ns / 1000.0 + offset_us:.3f},{dev},{metric},{value:.6g}\n")
    return len(samples)


PM_FILE = "pm.csv.gz"


def write_pm_csv(path: str, pm: Any, trace_minus_unix_us: float, label: str) -> dict[str, Any]:
    """Write PM samples as ``t0_us,t1_us,device,<column>...`` (gzipped, trace clock; one row per
    sample; counts turned into per-second rates) and return what meta.json keeps of them: rows,
    achieved gaps, the clock mapping (trace.pmclock.map_batches)."""
    import gzip

    import numpy as np

    from aiprof.agent.pmsampling import SCALE, is_count
    from aiprof.trace.pmclock import map_batches

    try:
        u0, u1, keep, mp = map_batches(pm.t0, pm.t1, pm.batches, pm.clock)
        mapping: dict[str, Any] = {"slope": mp.slope, "pairs": mp.pairs, "kept": mp.kept,
                                   "dropped_other_domain": mp.dropped, "invalid_times": mp.invalid, "max_decode_lag_ms": round(mp.max_lag_ms, 3)}
    except ValueError as exc:
        u0 = u1 = np.zeros(0)
        keep = np.zeros(len(pm.t0), dtype=bool)
        mapping = {"error": str(exc), "kept": 0, "dropped_other_domain": int(len(pm.t0))}
    a = u0[keep] / 1000.0 + trace_minus_unix_us
    b = u1[keep] / 1000.0 + trace_minus_unix_us
    vals = pm.values[keep].astype(np.float64)
    win_s = np.maximum((b - a) * 1e-6, 1e-9)
    for j, m in enumerate(pm.metrics):
        if is_count(m):
            vals[:, j] = vals[:, j] * SCALE.get(m, 1.0) / win_s
    with gzip.open(path, "wt", compresslevel=3) as f:
        f.write("t0_us,t1_us,device," + ",".join(pm.columns) + "\n")
        for i in range(len(a)):
            f.write(f"{a[i]:.3f},{b[i]:.3f},{label}," + ",".join(f"{v:.6g}" for v in vals[i].tolist()) + "\n")
    gaps = np.diff(a) if len(a) > 1 else np.zeros(0)
    return {
        "file": os.path.basename(path), "rows": int(len(a)), "device": label,
        "columns": pm.columns, "metrics": pm.metrics,
        "gap_us": {"median": round(float(np.median(gaps)), 3), "p99": round(float(np.percentile(gaps, 99)), 3),
                   "max": round(float(gaps.max()), 3)} if len(gaps) else None,
        "clock": {"pairs": pm.clock, "mapping": mapping, "trace_minus_unix_us": trace_minus_unix_us,
                  "method": "CUPTI time -> unix by a line through the clock pairs of the final timestamp domain "
                            "(one pair after each decode), then the capture's marker offset"},
        "stats": pm.stats,
    }
