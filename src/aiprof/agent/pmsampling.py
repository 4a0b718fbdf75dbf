"""GPU performance-monitor sampling at ~100 µs through CUPTI's PM sampling API.

This module runs in a capture's PM sampler process (agent/pmsidecar.py), never in the job's:
there, Kineto finalises CUPTI at each capture's stop and CUPTI refuses a second PM session.

The C side (pmsampling.c) is compiled on first use with the system C++ compiler against the
CUPTI headers (CUDA toolkit or the ``nvidia-*`` wheels) and cached like the attach shim. It
dlopen()s the job's libcupti (``LIBCUPTI_ENV``; else torch's wheel's, else the toolkit's). A
pthread of its own decodes the hardware buffer every ``DECODE_PERIOD_US`` into a bounded row
buffer; Python only configures, starts, stops and copies the rows out afterwards.

Every public entry catches everything: a failure becomes :class:`PmUnavailable` with a one-line
reason, which the sampler process sends to the agent (agent/hwmon.py), which records it in
meta.json and falls back to NVML/GPM.

Metrics are asked for by *role* (``ROLES``): each role lists CUPTI metric names to try in
order, and the first one the chip's PM sampler accepts (single pass) is used. docs/capture.md
lists the roles, the column each becomes and its unit.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiprof.agent import cbuild
from aiprof.protocol import COLUMN_UNITS, ROLES  # noqa: F401 (COLUMN_UNITS: for readers of pm.csv.gz)

#: Default sample period: the issue's 100 µs (10 kHz), fine enough for a 2 ms all-reduce.
DEFAULT_INTERVAL_US = 100
#: Shortest period we allow: below ~20 µs a sample holds a handful of SM cycles' worth of
#: counts and the decode thread cannot keep up with more than ~50k samples/s.
MIN_INTERVAL_US = 20
#: Longest period: beyond this NVML/GPM (100 ms windows) already covers the need.
MAX_INTERVAL_US = 100_000
#: How often our thread decodes the hardware buffer: 10 ms holds 100 samples at 100 µs.
DECODE_PERIOD_US = 10_000
#: Hardware buffer for raw records between decodes; 64 MiB leaves >10x slack over one period.
HW_BUFFER_BYTES = 64 << 20
#: One counter-data image holds this many decode periods' samples: the slack for a late decode.
#: (An image costs ~16 KB a sample on GH100 and is copied clean after every decode, so it is
#: sized to the interval instead of a fixed maximum.)
DECODE_SLACK = 3
MIN_SAMPLES_PER_DECODE = 64
#: Rows kept for one capture: 60 s (the longest capture) at 100 µs. Rows past it are counted
#: as dropped, never grown: 144 bytes a row (two times, 32 float slots) = 86 MB at most,
#: resident only as rows arrive.
MAX_ROWS = 600_000
#: Columns to leave out of the sampled set (comma list, e.g. "pm_nvlink_tx_Bps,pm_nvlink_rx_Bps").
SKIP_ENV = "AIPROF_PM_SKIP"
#: The libcupti to open, where set (agent/pmsidecar.py passes the job's to its sampler process).
LIBCUPTI_ENV = "AIPROF_PM_LIBCUPTI"
#: Bound on every wait for the C side (stop joins the decode thread).
STOP_TIMEOUT_S = 5.0

#: Counts that are not bytes -> bytes per event (an L2/DRAM sector is 32 bytes).
SCALE = {"dramc__sectors_op_read.sum": 32.0, "dramc__sectors_op_write.sum": 32.0, "lts__t_sectors.sum": 32.0}


def is_count(metric: str) -> bool:
    """True when the metric counts events in the window (turned into a per-second rate)."""
    return metric.endswith((".sum", ".max", ".avg")) and ".pct_" not in metric and ".per_" not in metric


class PmUnavailable(RuntimeError):
    """PM sampling cannot run here; ``str()`` is the one-line reason for meta.json."""


def _nvidia_dirs(sub: str) -> list[str]:
    """``sub`` folders of the nvidia-* wheels on sys.path (nvidia/cu13/include, nvidia/cuda_cupti/lib...)."""
    out: list[str] = []
    for p in sys.path:
        for pat in (f"nvidia/cu1*/{sub}", f"nvidia/cuda_cupti/{sub}", f"nvidia/cuda_runtime/{sub}"):
            out.extend(sorted(glob.glob(os.path.join(p or ".", pat)), reverse=True))
    return out


def _cuda_homes() -> list[str]:
    homes = [os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH")]
    homes += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    return [h for h in homes if h and os.path.isdir(h)]


def find_headers() -> list[str]:
    """Include folders that together hold cupti_pmsampling.h and cuda.h."""
    cands = [os.path.join(h, sub) for h in _cuda_homes() for sub in ("include", "extras/CUPTI/include")]
    cands += _nvidia_dirs("include")
    cupti = next((d for d in cands if os.path.isfile(os.path.join(d, "cupti_pmsampling.h"))), None)
    if cupti is None:
        raise PmUnavailable("CUPTI headers with cupti_pmsampling.h (CUDA 12.6+) not found "
                            "(set CUDA_HOME, or install the CUDA toolkit or nvidia-cuda-cupti)")
    dirs = [cupti]
    if not os.path.isfile(os.path.join(cupti, "cuda.h")):
        cuda = next((d for d in cands if os.path.isfile(os.path.join(d, "cuda.h"))), None)
        if cuda is None:
            raise PmUnavailable("cuda.h not found beside the CUPTI headers (set CUDA_HOME)")
        dirs.append(cuda)
    return dirs


def loaded_libcupti() -> str | None:
    """Path of the libcupti this process has already mapped (torch's, which Kineto uses)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if "/libcupti.so" in path:
                    return path
    except OSError:
        pass
    return None


def find_libcupti() -> str:
    """The libcupti to use: the one named by $AIPROF_PM_LIBCUPTI (the job's, given to its sampler
    process), the one already loaded, else torch's wheel's, else the toolkit's."""
    named = os.environ.get(LIBCUPTI_ENV)
    if named and os.path.isfile(named):
        return named
    got = loaded_libcupti()
    if got:
        return got
    cands: list[str] = []
    for d in _nvidia_dirs("lib"):
        cands += sorted(glob.glob(os.path.join(d, "libcupti.so*")), reverse=True)
    for h in _cuda_homes():
        for sub in ("lib64", "lib", "extras/CUPTI/lib64"):
            cands += sorted(glob.glob(os.path.join(h, sub, "libcupti.so*")), reverse=True)
    for c in cands:
        if os.path.isfile(c):
            return c
    raise PmUnavailable("libcupti not found (torch's nvidia-cuda-cupti wheel or the CUDA toolkit)")


def build_lib() -> str:
    """Compile pmsampling.c once per source and header version (cached); returns the .so path."""
    pre = os.environ.get("AIPROF_PMSAMPLING_LIB")
    if pre and os.path.exists(pre):  # built elsewhere (a host without a compiler)
        return pre
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pmsampling.c")
    incs = find_headers()
    headers = [os.path.join(d, "cupti_pmsampling.h") if os.path.isfile(os.path.join(d, "cupti_pmsampling.h"))
               else os.path.join(d, "cuda.h") for d in incs]
    try:
        return cbuild.build_cached("pmsampling", cbuild.digest([src, *headers]),
                                   ["-x", "c++", "-shared", "-fPIC", "-O2", src, *(f"-I{d}" for d in incs),
                                    "-ldl", "-lpthread"], "PM sampler")
    except cbuild.BuildError as exc:
        raise PmUnavailable(str(exc)) from exc


_LIB: Any = None
_LIB_ERROR: PmUnavailable | None = None  # why loading failed: not retried in this process
_LIB_LOCK = threading.Lock()


def _load() -> Any:
    """Build, load and open the library once per process (a failure is kept, not retried)."""
    global _LIB, _LIB_ERROR
    with _LIB_LOCK:
        if _LIB is not None:
            return _LIB
        if _LIB_ERROR is not None:
            raise PmUnavailable(str(_LIB_ERROR))
        try:
            _LIB = _open()
        except PmUnavailable as exc:
            _LIB_ERROR = exc
            raise
        except Exception as exc:  # OSError from dlopen, ...
            _LIB_ERROR = PmUnavailable(f"loading the PM sampler: {type(exc).__name__}: {exc}")
            raise _LIB_ERROR from exc
        return _LIB


def _open() -> Any:
    """Build and load the C side, open libcupti through it."""
    so = build_lib()
    lib = ctypes.CDLL(so)
    c_u64p, c_i64p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int64)
    lib.aps_error.restype = ctypes.c_char_p
    lib.aps_chip.restype = ctypes.c_char_p
    lib.aps_open.argtypes = [ctypes.c_char_p]
    lib.aps_clock_pair.argtypes = [ctypes.c_int, c_u64p, c_i64p, c_i64p]
    lib.aps_list_metrics.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.aps_passes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
    lib.aps_configure.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_uint64,
                                  ctypes.c_size_t, ctypes.c_uint32, ctypes.c_size_t]
    lib.aps_start.argtypes = [ctypes.c_uint]
    lib.aps_row_count.restype = ctypes.c_size_t
    lib.aps_copy_rows.restype = ctypes.c_size_t
    lib.aps_copy_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.aps_stats.argtypes = [c_u64p, ctypes.POINTER(ctypes.c_double)]
    lib.aps_counter_data_bytes.restype = ctypes.c_size_t
    path = find_libcupti()
    if lib.aps_open(path.encode()) != 0:
        raise PmUnavailable(f"CUPTI: {lib.aps_error().decode(errors='replace')}")
    lib.cupti_path = path
    return lib


def _err(lib: Any) -> str:
    return lib.aps_error().decode(errors="replace")


def _names(names: list[str]) -> Any:
    arr = (ctypes.c_char_p * len(names))()
    arr[:] = [n.encode() for n in names]
    return arr


def clock_pair(lib: Any, tries: int = 20) -> dict[str, int]:
    """One (CUPTI timestamp, unix ns) pair, the narrowest bracket of ``tries`` reads."""
    c, u, b = ctypes.c_uint64(), ctypes.c_int64(), ctypes.c_int64()
    if lib.aps_clock_pair(tries, ctypes.byref(c), ctypes.byref(u), ctypes.byref(b)) != 0:
        raise PmUnavailable("cuptiGetTimestamp failed")
    return {"cupti_ns": int(c.value), "unix_ns": int(u.value), "bracket_ns": int(b.value)}


def list_metrics(device: int = 0) -> list[tuple[int, str]]:
    """(metric type 0 counter/1 ratio/2 throughput, base name) the PM sampler offers on ``device``."""
    lib = _load()
    size = 1 << 20
    buf = ctypes.create_string_buffer(size)
    rc = lib.aps_list_metrics(device, buf, size)
    if rc < 0:
        raise PmUnavailable(f"listing PM sampling metrics: {_err(lib)}")
    out = []
    for line in buf.value.decode(errors="replace").splitlines():
        t, _, name = line.partition("\t")
        if name:
            out.append((int(t), name))
    return out


_METRICS: dict[int, dict[str, str]] = {}  # device -> resolved metrics, for this process
# One resolution at a time: the agent's prewarm thread and a capture's sampler both ask, and two
# resolutions at once on the C side (not thread-safe) each saw every metric rejected (H200).
_METRICS_LOCK = threading.Lock()


def prewarm(device: int) -> dict[str, str]:
    """Load the library and resolve the metrics of ``device`` now (kept for the process), so a
    later :class:`PmSampler` only configures and starts; a caller that comes while another
    resolves waits for its answer."""
    with _METRICS_LOCK:
        if device not in _METRICS:
            _METRICS[device] = resolve_metrics(device)
        return _METRICS[device]


def _cache_file(chip: str) -> str:
    try:
        return os.path.join(cbuild.cache_dir(), f"pm-metrics-{chip or 'unknown'}-v1.json")
    except cbuild.BuildError as exc:
        raise PmUnavailable(str(exc)) from exc


def resolve_metrics(device: int = 0, roles: list[tuple[str, str, list[str]]] | None = None,
                    diagnose: dict | None = None) -> dict[str, str]:
    """column -> CUPTI metric: per role the first candidate the chip accepts, all in one pass.

    The answer is cached per chip (resolving costs seconds: each check builds a config image).
    All first candidates are tried together first; one by one only when that fails. Roles are
    in priority order: if the set needs more than one pass (PM sampling takes one), the last
    roles are dropped until it fits. ``diagnose`` (a dict) receives why each rejected candidate
    failed, and bypasses the cache.
    """
    import json

    lib = _load()
    skip = {c.strip() for c in os.environ.get(SKIP_ENV, "").split(",") if c.strip()}
    roles = roles or ([r for r in ROLES if r[0] not in skip] if skip else ROLES)
    firsts = [(c, cands[0]) for c, _u, cands in roles]
    rc_all = lib.aps_passes(device, _names([m for _, m in firsts]), len(firsts))
    chip = lib.aps_chip().decode(errors="replace")
    cache = _cache_file(chip) if chip and roles is ROLES else None
    if cache and os.path.exists(cache) and diagnose is None:
        try:
            with open(cache) as f:
                got = json.load(f)
            if isinstance(got, dict) and got:
                return {str(k): str(v) for k, v in got.items()}
        except (OSError, ValueError):
            pass
    chosen: dict[str, str] = {}
    if rc_all == 1:
        chosen = dict(firsts)
    else:
        if diagnose is not None:
            diagnose["all first candidates"] = f"passes {rc_all}" if rc_all > 1 else _err(lib)
        for col, _unit, cands in roles:
            for name in cands:
                rc = lib.aps_passes(device, _names([name]), 1)
                if rc == 1:
                    chosen[col] = name
                    break
                if diagnose is not None:
                    diagnose[name] = f"passes {rc}" if rc > 1 else _err(lib)
    cols = list(chosen)
    while cols:
        names = [chosen[c] for c in cols]
        rc = lib.aps_passes(device, _names(names), len(names))
        if rc == 1:
            break
        if diagnose is not None:
            diagnose[f"set of {len(names)}"] = f"passes {rc}" if rc > 1 else _err(lib)
        cols.pop()
    out = {c: chosen[c] for c in cols}
    if cache and out:
        try:
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, cache)
        except OSError:
            pass
    return out


@dataclass
class PmSamples:
    """What one PM sampling run produced: times in CUPTI ns, values per column."""

    device: int
    columns: list[str]
    metrics: list[str]
    t0: np.ndarray  # uint64 CUPTI ns, sample start
    t1: np.ndarray  # uint64 CUPTI ns, sample end
    values: np.ndarray  # float32 [n, len(columns)]
    clock: list[dict[str, int]] = field(default_factory=list)  # clock pairs at start and stop
    batches: list[dict[str, int]] = field(default_factory=list)  # (row_end, cupti_ns, unix_ns) after each decode
    stats: dict[str, Any] = field(default_factory=dict)


class PmSampler:
    """One device's PM sampling for one capture: configure, start, stop, rows."""

    def __init__(self, device: int = 0, interval_us: int = DEFAULT_INTERVAL_US,
                 metrics: dict[str, str] | None = None, max_rows: int = MAX_ROWS) -> None:
        if not MIN_INTERVAL_US <= interval_us <= MAX_INTERVAL_US:
            raise PmUnavailable(f"PM sample interval {interval_us} µs outside {MIN_INTERVAL_US}..{MAX_INTERVAL_US}")
        self.device = device
        self.interval_us = interval_us
        self.max_rows = max_rows
        t0 = time.perf_counter()
        self.lib = _load()
        t1 = time.perf_counter()
        self.chip = ""
        self.metrics = metrics or prewarm(device)
        t2 = time.perf_counter()
        if not self.metrics:
            raise PmUnavailable("no PM sampling metric accepted on this GPU")
        self.clock: list[dict[str, int]] = []
        self.started = False
        self.reset: str | None = None  # why the PM sampling object had to be re-created, if it did
        cols = list(self.metrics)
        names = [self.metrics[c] for c in cols]
        rc = self._configure(names)
        if rc != 0:  # once more from a fresh object (Kineto's teardown needed it in-process; now a guard)
            first = _err(self.lib)
            if self.lib.aps_reset() != 0 or self._configure(names) != 0:
                raise PmUnavailable(f"PM sampling setup: {first}; after a reset: {_err(self.lib)}")
            self.reset = first
        self.chip = self.lib.aps_chip().decode(errors="replace")  # known once configured (or resolved)
        self.columns = cols
        self.timing_ms = {"load": round((t1 - t0) * 1e3, 1), "metrics": round((t2 - t1) * 1e3, 1),
                          "configure": round((time.perf_counter() - t2) * 1e3, 1)}

    def _configure(self, names: list[str]) -> int:
        per = max(MIN_SAMPLES_PER_DECODE, DECODE_SLACK * DECODE_PERIOD_US // self.interval_us)
        return int(self.lib.aps_configure(self.device, _names(names), len(names), self.interval_us * 1000,
                                          HW_BUFFER_BYTES, per, self.max_rows))

    def start(self) -> None:
        """Start sampling on the GPU and the decode thread (returns at once)."""
        self.clock.append(clock_pair(self.lib))
        if self.lib.aps_start(DECODE_PERIOD_US) != 0:
            first = _err(self.lib)
            names = [self.metrics[c] for c in self.columns]
            if self.lib.aps_reset() == 0 and self._configure(names) == 0 and self.lib.aps_start(DECODE_PERIOD_US) == 0:
                self.reset = first
                self.started = True
                return
            raise PmUnavailable(f"PM sampling start: {_err(self.lib)}")
        self.started = True

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> PmSamples:
        """Stop (bounded wait) and return every row kept."""
        if not self.started:
            raise PmUnavailable("PM sampler was not started")
        rc: list[int] = []
        t = threading.Thread(target=lambda: rc.append(self.lib.aps_stop()), name="aiprof-pm-stop", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise PmUnavailable(f"PM sampling stop did not return within {timeout:.0f} s")
        self.started = False
        self.clock.append(clock_pair(self.lib))
        n = int(self.lib.aps_row_count())
        m = len(self.columns)
        t0 = np.zeros(n, dtype=np.uint64)
        t1 = np.zeros(n, dtype=np.uint64)
        vals = np.zeros((n, m), dtype=np.float32)
        if n:
            got = self.lib.aps_copy_rows(t0.ctypes.data, t1.ctypes.data, vals.ctypes.data, n)
            t0, t1, vals = t0[:got], t1[:got], vals[:got]
        nb = int(self.lib.aps_batch_count())
        re_, bc, bu = np.zeros(nb, np.uint64), np.zeros(nb, np.uint64), np.zeros(nb, np.int64)
        if nb:
            self.lib.aps_copy_batches(re_.ctypes.data, bc.ctypes.data, bu.ctypes.data)
        batches = [{"row_end": int(a), "cupti_ns": int(b), "unix_ns": int(c)} for a, b, c in zip(re_, bc, bu)]
        u = (ctypes.c_uint64 * 5)()
        d = (ctypes.c_double * 2)()
        self.lib.aps_stats(u, d)
        stats = {"dropped": int(u[0]), "overflows": int(u[1]), "decode_errors": int(u[2]), "decodes": int(u[3]),
                 "image_full": int(u[4]), "decode_s": round(d[0], 6), "evaluate_s": round(d[1], 6),
                 "stop_rc": rc[0] if rc else None, "chip": self.chip, "cupti": self.lib.cupti_path,
                 "interval_us": self.interval_us, "reset": self.reset, "counter_data_bytes": int(self.lib.aps_counter_data_bytes())}
        if rc and rc[0] != 0:
            stats["stop_error"] = _err(self.lib)
        return PmSamples(self.device, list(self.columns), [self.metrics[c] for c in self.columns],
                         t0, t1, vals, list(self.clock), batches, stats)

