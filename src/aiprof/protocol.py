"""What the aiprof side and the agent agree on: capture requests (what to record, when to start,
when to stop; plain data, JSON round-trip) and the columns of the files the agent writes.

A request travels from the CLI to the agent (environment variable for ``aiprof run``, control
socket for ``aiprof trigger``/``attach``), so it is a flat dict of JSON types. This module sits
on the ground floor (standard library only; the probe file's checks are imported when a request
carries one) so that the agent, the CLI and the service all import it downwards.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

#: Richness levels a capture can ask for. ``kernels`` = CPU ops + CUDA activities (always on).
WHAT_LEVELS = ("kernels", "python", "shapes", "memory", "flops", "hw")
DEFAULT_WHAT = ("kernels", "hw")
#: Levels recorded by the native sidecar (aiprof.native), not part of "all": ``syscalls`` samples
#: /proc for blocked system calls, ``native`` runs py-spy --native, which pauses the job to unwind.
NATIVE_LEVELS = ("syscalls", "native")

# Hard limits: a request outside them is clamped, so a typo cannot record for an hour.
MAX_ITERATIONS = 100
MIN_DURATION_MS = 10
MAX_DURATION_MS = 60_000
DEFAULT_DURATION_MS = 2000
DEFAULT_MAX_TRACE_MB = 512
#: CUPTI PM sampling period (µs) under --what hw; 0 turns it off. Bounds: agent/pmsampling.py.
#: On by default since its cost against kernel tracing alone measured ×1.009 (median of 5 paired
#: rounds, GPT-2 on an H100; rounds 0.957-1.038) and 10 4-rank jobs on 4 H100s had counters in every capture, none
#: crashing (docs/capture.md, "What it costs"); NVML/GPM is the fallback where it cannot run.
DEFAULT_HW_PM_INTERVAL_US = 100
RECOMMENDED_HW_PM_INTERVAL_US = 100
#: A capture with PM counters at fixed iterations prepares its profiler this long ahead, so that
#: its sampler process is set up when the first iteration starts: 0.9-1.1 s alone on an H100,
#: 1.4-3.5 s with 4 ranks setting up at once on 4 H100s (each process resolving its metrics,
#: which it no longer does; bench/pm_repeat.sh); the planners of a common start
#: (attach/trigger.py, server/registry.py) leave as much room.
PM_SETUP_LEAD_S = 4.0
#: ... and this much more while an agent has not loaded its PM sampler's library and resolved its
#: metrics (agents report ``pm_ready``): 0.6-11.5 s in a fresh process on 4 H100s, the longest
#: compiling the C side.
PM_PREWARM_LEAD_S = 12.0
MIN_HW_PM_INTERVAL_US = 20
MAX_HW_PM_INTERVAL_US = 100_000


def wants_pm(what: tuple[str, ...] | list[str], pm_interval_us: int) -> bool:
    """Whether a capture asks for CUPTI PM counters."""
    return "hw" in what and bool(pm_interval_us)


def pm_lead_s(what: tuple[str, ...] | list[str], pm_interval_us: int, all_ready: bool, all_off: bool = False) -> float:
    """Room a planner leaves before a common start for the PM sampler to run on every rank.
    ``all_ready``: every agent has its sampler's metrics (or will not sample); ``all_off``: no
    agent will sample (CPU jobs, or PM sampling failed there for good: agents report ``pm_off``)."""
    if not wants_pm(what, pm_interval_us) or all_off:
        return 0.0
    return PM_SETUP_LEAD_S + (0.0 if all_ready else PM_PREWARM_LEAD_S)


class RequestError(ValueError):
    """A capture request that cannot be honoured (bad option value)."""


def parse_what(spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Parse ``"kernels,python"`` (or ``"all"``) into a normalised tuple of levels."""
    if spec is None or spec == "":
        return DEFAULT_WHAT
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in items:
        name = raw.strip().lower()
        if not name:
            continue
        if name == "all":
            return WHAT_LEVELS
        if name == "stack" or name == "stacks":
            name = "python"
        if name not in WHAT_LEVELS and name not in NATIVE_LEVELS:
            raise RequestError(f"unknown --what level {raw!r}; choose from "
                               f"{', '.join(WHAT_LEVELS + NATIVE_LEVELS)} or all")
        if name not in out:
            out.append(name)
    if "kernels" not in out:
        out.insert(0, "kernels")
    return tuple(out)


def new_capture_id() -> str:
    """A sortable, unique-enough id: ``20260101-120000-ab12``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass
class CaptureRequest:
    """One capture: skip N iterations then record M, or record D milliseconds.

    ``start_at``, when set, is an absolute iteration number (the agent's own count) to start
    at; ``aiprof trigger`` uses it to make every rank record the same iterations.
    ``wait_ms``: if no iteration boundary is seen this long after the request arrives, record
    ``duration_ms`` on the main thread instead (None = wait for iterations forever).
    """

    out: str = "aiprof-captures"
    capture_id: str = field(default_factory=new_capture_id)
    what: tuple[str, ...] = DEFAULT_WHAT
    skip: int = 0
    iterations: int | None = None
    duration_ms: int | None = None
    start_at: int | None = None
    wait_ms: int | None = None
    warmup: bool = True
    hw_interval_ms: int = 100
    hw_pm_interval_us: int = DEFAULT_HW_PM_INTERVAL_US
    max_trace_mb: int = DEFAULT_MAX_TRACE_MB
    entry: str | None = None
    trigger: dict[str, Any] | None = None  # why the agent captured by itself (auto-trigger), else None
    probes: dict[str, Any] | None = None  # a validated probe file (aiprof.native.probes.ProbeSpec.to_dict)
    syscall_interval_ms: float = 2.0  # /proc sampling period for --what syscalls

    def native_config(self) -> dict[str, Any] | None:
        """What the native sidecar must do for this request, or None when nothing native is asked."""
        want_sys, want_native = "syscalls" in self.what, "native" in self.what
        if not (self.probes or want_sys or want_native):
            return None
        return {"probes": self.probes, "syscalls": want_sys, "native_stacks": want_native,
                "syscall_interval_s": self.syscall_interval_ms / 1e3}

    def normalised(self) -> "CaptureRequest":
        """Validate and clamp every field; returns self. Raises RequestError on nonsense."""
        self.what = parse_what(self.what)
        if self.skip < 0:
            raise RequestError("--skip must be >= 0")
        if self.iterations is not None:
            if self.iterations < 1:
                raise RequestError("--iterations must be >= 1")
            self.iterations = min(int(self.iterations), MAX_ITERATIONS)
        if self.duration_ms is not None:
            if self.duration_ms <= 0:
                raise RequestError("--duration-ms must be > 0")
            self.duration_ms = max(MIN_DURATION_MS, min(int(self.duration_ms), MAX_DURATION_MS))
        if self.iterations is None and self.duration_ms is None:
            self.iterations = 3
        if self.wait_ms is not None and self.wait_ms < 0:
            raise RequestError("--wait-ms must be >= 0")
        self.hw_interval_ms = max(10, min(int(self.hw_interval_ms), 10_000))
        pm_us = int(self.hw_pm_interval_us)
        if pm_us != 0 and not MIN_HW_PM_INTERVAL_US <= pm_us <= MAX_HW_PM_INTERVAL_US:
            raise RequestError(f"--hw-pm-interval-us must be 0 (off) or {MIN_HW_PM_INTERVAL_US}..{MAX_HW_PM_INTERVAL_US}")
        self.hw_pm_interval_us = pm_us
        self.syscall_interval_ms = max(0.5, min(float(self.syscall_interval_ms), 1000.0))
        if self.probes is not None:
            from aiprof.native.probes import ProbeError, ProbeSpec

            try:
                self.probes = ProbeSpec.from_dict(self.probes).to_dict()
            except (ProbeError, AttributeError, TypeError) as exc:
                raise RequestError(f"bad probes in the request: {exc}") from None
        self.max_trace_mb = max(1, int(self.max_trace_mb))
        if self.entry is not None and ":" not in self.entry:
            raise RequestError(f"--entry {self.entry!r} must look like module:qualname")
        if not self.capture_id or "/" in self.capture_id or self.capture_id.startswith("."):
            raise RequestError(f"bad capture id {self.capture_id!r}")
        return self

    @property
    def fallback_duration_ms(self) -> int:
        """How long a time-based capture lasts when no iteration is seen."""
        return self.duration_ms if self.duration_ms is not None else DEFAULT_DURATION_MS

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["what"] = list(self.what)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaptureRequest":
        """Build from a dict, ignoring unknown keys (newer CLI, older agent)."""
        names = {f.name for f in dataclasses.fields(cls)}
        req = cls(**{k: v for k, v in d.items() if k in names})
        if isinstance(req.what, list):
            req.what = tuple(req.what)
        return req.normalised()


def runtime_dir(uid: int | None = None) -> str:
    """The per-user folder of agent control sockets: ``$AIPROF_RUNTIME_DIR`` or /tmp/aiprof-<uid>."""
    env = os.environ.get("AIPROF_RUNTIME_DIR")
    if env:
        return env
    return os.path.join("/tmp", f"aiprof-{os.getuid() if uid is None else uid}")


# --- pm.csv.gz (agent/pmsampling.py): its columns, their units and the CUPTI metrics behind them ---
# role -> (column, unit, candidate CUPTI metric names, best first). Columns carry their unit;
# "_pct" columns are 0-100 of the unit's peak over the sample window. A candidate that counts
# events in the window (``is_count``: bytes, sectors, cycles) becomes the column's unit per
# second: times SCALE, divided by the window's length when the samples are written
# (agent/hwmon.py). GH100 names read off the chip's PM-sampling metric list (bench/pm_probe.py
# writes it): byte counters there take no ".per_second" rollup, so bytes are counted and turned
# into rates here.
ROLES: list[tuple[str, str, list[str]]] = [
    ("pm_sm_active_pct", "%", ["sm__cycles_active.avg.pct_of_peak_sustained_elapsed"]),
    ("pm_sm_issue_pct", "%", ["sm__inst_executed_realtime.avg.pct_of_peak_sustained_elapsed",
                              "sm__inst_executed.avg.pct_of_peak_sustained_elapsed"]),
    ("pm_tensor_active_pct", "%", ["sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed",
                                   "sm__pipe_tensor_op_hmma_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed",
                                   "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"]),
    ("pm_dram_read_Bps", "B/s", ["dram__bytes_read.sum", "dramc__sectors_op_read.sum"]),
    ("pm_dram_write_Bps", "B/s", ["dram__bytes_write.sum", "dramc__sectors_op_write.sum"]),
    ("pm_nvlink_tx_Bps", "B/s", ["nvltx__bytes.sum"]),
    ("pm_nvlink_rx_Bps", "B/s", ["nvlrx__bytes.sum"]),
    ("pm_pcie_read_Bps", "B/s", ["pcie__read_bytes.sum"]),
    ("pm_pcie_write_Bps", "B/s", ["pcie__write_bytes.sum"]),
    ("pm_l2_Bps", "B/s", ["lts__t_bytes.sum", "lts__t_sectors.sum"]),
    ("pm_dram_pct", "%", ["dram__throughput.avg.pct_of_peak_sustained_elapsed",
                          "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                          "dramc__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("pm_l2_pct", "%", ["lts__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("pm_warps_active_pct", "%", ["sm__warps_active_realtime.avg.pct_of_peak_sustained_elapsed",
                                  "sm__warps_active.avg.pct_of_peak_sustained_elapsed"]),
    ("pm_gpc_clock_hz", "Hz", ["gpc__cycles_elapsed.max", "gpc__cycles_elapsed.avg"]),
]
COLUMN_UNITS = {col: unit for col, unit, _ in ROLES}
