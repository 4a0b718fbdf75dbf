"""The capture driver: starts and stops torch.profiler at iteration boundaries, then exports.

State machine (one capture at a time)::

    IDLE --submit--> ARMED --boundary k == start-1--> (prepare: CUPTI warm-up)
    ARMED --boundary k >= start--> RECORDING --M steps or D ms--> EXPORTING --> IDLE
    ARMED --no boundary for wait_ms--> time-based RECORDING on the main thread

Start and stop always run on the thread that runs the steps (inside the step hooks), or on the
main thread through a pending call for time-based captures: never from the agent's own threads.
Each recorded iteration is wrapped in a ``ProfilerStep#<k>`` record_function, ``k`` being the
job's own iteration number, so all ranks of a job name the same iteration the same way.

The stop itself is a detach (agent/offstop.py): the training thread takes the profiler's state
out of its thread-local slot (microseconds) and the export thread finishes it, Kineto's
post-processing and the trace's save running there with the GIL released. Where the stopper
is unavailable the training thread runs torch's ``stop_trace`` and the trace is written on the
export thread, or for a large one in a forked child (agent/traceout.py: Kineto's writer holds
the GIL). Then hw.csv and meta.json; meta.json is written last, so its presence means the
capture is complete. meta.json's ``stop`` and ``export`` record how and what it cost.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import socket
import sys
import threading
import time
from typing import Any, Callable

from aiprof.agent import cupti_teardown, log, offstop, profguard
from aiprof.agent.commsettings import comm_settings
from aiprof.protocol import PM_SETUP_LEAD_S, CaptureRequest, wants_pm

IDLE, ARMED, RECORDING, EXPORTING = "idle", "armed", "recording", "exporting"
CLOCK_MARKER = "aiprof::clock_sync"
# The marker is taken up to this many times (named CLOCK_MARKER#k) and the tightest bracket
# kept: a thread preempted between its two clock reads widens one by milliseconds on a loaded
# machine, and every file placed on the trace clock by it (calls, syscalls, counters) moves.
CLOCK_MARKER_TRIES = 5
# Kineto's ts are µs of Unix time since the trace's baseTimeNanoseconds, so the base gives the
# offset without the marker's error (half its bracket, up to milliseconds when the thread is
# preempted inside it). The base is taken when the marker's bracket holds it, give or take the
# profiler's own TSC -> Unix conversion (the 115 committed captures, CPU and H100/H200: the base
# inside the bracket, median 3 µs from the midpoint, at most 52); a trace on another clock
# (monotonic, say) is far outside and keeps the marker's offset.
CLOCK_BASE_SLACK_US = 1000.0
# A bracket this tight is kept at once (two time_ns() reads around a record_function: ~5-30 µs).
CLOCK_MARKER_GOOD_NS = 50_000
META_SCHEMA = "aiprof.capture/1"
START_TIMEOUT_S = 10.0  # a pending call on a main thread that runs no Python for this long is dropped
EXPORT_WAIT_AT_EXIT_S = 30.0
# the job starts its own profiler while a detached one is finishing: wait this long for the finish
# (Kineto's post-processing, seconds at most), so the two do not share Kineto
JOB_PROFILER_WAIT_S = 30.0
OFFSTOP_ENV = "AIPROF_OFFSTOP"  # 0: stop the profiler on the training thread (torch's own stop_trace)
# PM counters come from a sampler process per capture (agent/pmsidecar.py). So that the first
# recorded step has samples, a capture with them goes: while armed, a first sampler process
# builds the C side and resolves the GPU's metrics (cached per chip; 0.6-11.5 s the first time
# on 4 H100s, the longest compiling); at the capture, the capture's sampler process starts
# while the profiler is prepared, and sets CUPTI up and configures only once it is (never both
# at once: that crashed 3 of 7 4-rank jobs); sampling starts (1.4-2.9 s after the process with
# 4 ranks at once on 4 H100s), then the recording. The job is never held: iterations go on and only the recording starts later, at
# most this long after the request; past it the capture records without PM counters (a
# resolution still running then is not stopped).
PM_READY_MAX_S = 30.0
# A request for fixed iterations (``start_at``: every rank of a job records the same ones) has its
# profiler prepared protocol.PM_SETUP_LEAD_S ahead (by the median iteration), so that the
# sampler's set-up is over by then. Only a sampler whose library is not ready makes it start later.

DoneCallback = Callable[[dict], None]


def _holds_the_job(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark the time a driver method runs on the job's thread (profiler prepare/start/stop):
    the auto-trigger must not take the agent's own work for a stall of the job."""
    @functools.wraps(fn)
    def wrapper(self: "CaptureDriver", *args: Any, **kwargs: Any) -> Any:
        self.holding_since = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.held_until = time.perf_counter()
            self.holding_since = None
    return wrapper


def rank_info() -> dict[str, int | None]:
    """Rank, world size and local rank from torch.distributed if initialised, else env vars."""
    rank = world = None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass

    def env_int(name: str) -> int | None:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    if rank is None:
        rank = env_int("RANK")
    if world is None:
        world = env_int("WORLD_SIZE")
    return {"rank": rank if rank is not None else 0, "world_size": world if world is not None else 1,
            "local_rank": env_int("LOCAL_RANK")}


def clock_marker(record_function) -> dict:
    """Record the clock marker (see CLOCK_MARKER_TRIES): ``marker_unix_ns`` [t0, t1] around the
    kept marker's record_function, and its ``marker_name``."""
    best: tuple[int, int, str] | None = None
    for k in range(CLOCK_MARKER_TRIES):
        name = f"{CLOCK_MARKER}#{k}"
        t0 = time.time_ns()
        with record_function(name):
            t1 = time.time_ns()
        if best is None or t1 - t0 < best[1] - best[0]:
            best = (t0, t1, name)
        if t1 - t0 <= CLOCK_MARKER_GOOD_NS:
            break
    assert best is not None
    return {"marker_unix_ns": [best[0], best[1]], "marker_name": best[2]}


def trace_offset(marker_ts: float, marker_unix_ns: list[int], marker_name: str,
                 base_ns: int | None) -> dict[str, Any]:
    """The trace clock's offset from Unix time, ``trace_minus_unix_us``, and how it was found:
    the trace's baseTimeNanoseconds where the marker's bracket holds it (CLOCK_BASE_SLACK_US),
    else the marker's ts against its bracket's midpoint. ``uncertainty_us``: half the bracket."""
    t0, t1 = marker_unix_ns
    half_us = (t1 - t0) / 2000.0
    measured = marker_ts - (t0 + t1) / 2000.0
    marker = f"record_function {marker_name!r} between two time.time_ns() reads, the tightest of up to " \
             f"{CLOCK_MARKER_TRIES}"
    out: dict[str, Any] = {"uncertainty_us": round(half_us, 3), "marker_ts_us": marker_ts,
                           "marker_offset_us": round(measured, 3)}
    if base_ns is not None:
        out["base_time_ns"] = base_ns
        if abs(measured + base_ns / 1000.0) <= half_us + CLOCK_BASE_SLACK_US:
            return {**out, "trace_minus_unix_us": -base_ns / 1000.0,
                    "method": f"the trace's baseTimeNanoseconds, inside the bracket of the {marker}"}
    return {**out, "trace_minus_unix_us": round(measured, 3), "method": marker}


def job_device() -> int | None:
    """The calling thread's CUDA device when the job has initialised CUDA (never initialises it);
    called on the job's stepping thread, whose device is the job's."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.current_device())
    except Exception:
        return None


class CaptureDriver:
    """Owns the profiler of one process. Thread-safe enough: the hot path reads one attribute."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.state = IDLE
        self.req: CaptureRequest | None = None
        self._lock = threading.Lock()
        self._callbacks: list[DoneCallback] = []
        self._listeners: list[DoneCallback] = []  # called for every capture (the server uplink)
        self._reset()
        self.last_result: dict | None = None
        self.captures_done = 0
        self._pm_prewarm_started = False  # once per process: the PM sampler's library and metrics
        self._pm_prewarmed = threading.Event()  # ... and that work is over (resolved or failed)
        self.pm_prewarm_error: str | None = None  # why it failed: no PM set-up in this process
        # a capture's PM sampling failed in a way the next would repeat (hwmon.pm_failure_lasts)
        self.pm_lasting_error: str | None = None
        self.pm_prewarm_s: float | None = None  # how long it took (meta.json hw.pm.prewarm_s)
        self.pm_metrics: dict[str, str] | None = None  # the metrics it resolved, given to each capture's sampler
        # the job's CUDA device as its stepping thread sees it (torch.cuda.current_device() is the
        # calling thread's: the agent's threads would see device 0 on every rank); read once
        self.job_device: int | None = None
        self.holding_since: float | None = None  # perf_counter while prepare/start/stop runs on the job's thread
        self.held_until: float | None = None  # when the last of those ended

    def _reset(self) -> None:
        self.start_at: int | None = None
        self.prof: Any = None
        self.prepared = False
        self.mode = ""
        self.step_rf: Any = None
        self.steps: list[int] = []
        self.first_step_t = 0.0
        self.t_start = 0.0
        self.t_start_unix_ns = 0
        self.clock: dict[str, Any] = {}
        self.armed_at = 0.0
        self.armed_count = 0
        self.sampler: Any = None
        self.pm_meta: dict[str, Any] | None = None
        self.pm_wanted: bool | None = None  # _pm_wanted's answer for this capture
        self.info: dict[str, Any] = {}
        self.pending_main: str | None = None  # "start"/"stop" scheduled on the main thread
        self.pending_since = 0.0
        self.before_ms: list[float] = []
        self.during_ms: list[float] = []
        self.errors: list[str] = []
        self.export_thread: threading.Thread | None = None
        self.prof_thread: int | None = None  # the thread that prepared or started self.prof
        self.native: Any = None  # agent.native.NativeSidecar when the request asks for native data
        self.native_cfg: dict | None = None  # what the sidecar must do, until it is launched
        self.native_launched_at: float | None = None
        self.native_recording = False
        self.detached: int | None = None  # offstop handle: the profiler awaits its finish on the export thread
        self.finished = threading.Event()  # clear while a detached profiler is not finished
        self.finished.set()

    # -- control side (agent threads) ---------------------------------------------------------
    def submit(self, req: CaptureRequest, on_done: DoneCallback | None = None) -> str | None:
        """Arm a capture; returns None if accepted, else why not (e.g. one is in progress)."""
        with self._lock:
            if self.state != IDLE:
                return f"busy: a capture is {self.state}"
            self._reset()
            self.req = req
            self._callbacks = [on_done] if on_done else []
            self.armed_at = time.perf_counter()
            self.armed_count = self.agent.tracker.count
            self.state = ARMED
        self.native_cfg = req.native_config()
        offstop.prepare()  # the stopper builds in the background (cached): ready long before the stop
        return None

    def _maybe_launch_native(self) -> None:
        """Start (or reuse) the native sidecar once the job is in steady state (after a step has
        ended, or NATIVE_NO_STEPS_S without steps), from the main thread, which then waits for
        the sidecar's hooks. Frida's injector takes over the main thread for a moment; taken
        while that thread was inside libc (malloc), it deadlocked the job here (seen twice, right
        after ``import torch`` and in a steady loop). Parked in a wait, it holds no libc lock."""
        from aiprof.agent.mainthread import call_soon_in_main_thread
        from aiprof.agent.native import NATIVE_NO_STEPS_S

        if self.native_cfg is None or self.native_launched_at is not None:
            return
        steady = self.agent.tracker.count > 0
        if not steady and time.perf_counter() - self.armed_at < NATIVE_NO_STEPS_S:
            return
        self.native_launched_at = time.perf_counter()
        if not call_soon_in_main_thread(self._native_launch_main):
            self.errors.append("native sidecar: the interpreter refused a main-thread call")
            self.native_cfg = None

    def _native_launch_main(self) -> None:
        """On the main thread: launch the sidecar and wait (bounded) until its hooks are in."""
        from aiprof.agent.native import READY_TIMEOUT_S, sidecar_for

        cfg = self.native_cfg
        if cfg is None or self.state is not ARMED:
            return
        self.holding_since = time.perf_counter()  # the auto-trigger must not take this wait for a stall
        try:
            nat = sidecar_for(cfg)
            if nat.error:
                self.errors.append(nat.error)
                self.native_cfg = None
                return
            self.native = nat  # visible to _native_pending, which gives up on it after READY_TIMEOUT_S
            nat.wait_ready(READY_TIMEOUT_S)  # a futex wait, GIL released: Frida attaches meanwhile
        except Exception as exc:
            self.errors.append(f"native sidecar: {type(exc).__name__}: {exc}")
            self.native_cfg = None
        finally:
            self.held_until = time.perf_counter()
            self.holding_since = None

    def _native_pending(self) -> bool:
        """True while the sidecar is not launched or still setting its hooks: the capture's start
        waits for it, bounded (then it records without native data and says so)."""
        if self.native_cfg is None:
            return False
        from aiprof.agent.native import NATIVE_NO_STEPS_S, READY_TIMEOUT_S

        nat = self.native
        if nat is not None and nat.poll_ready():
            return False
        since = self.native_launched_at if self.native_launched_at is not None else self.armed_at
        # launched: the main thread runs the launch at its next Python instruction (START_TIMEOUT_S)
        limit = (START_TIMEOUT_S + READY_TIMEOUT_S if self.native_launched_at is not None
                 else NATIVE_NO_STEPS_S + START_TIMEOUT_S + READY_TIMEOUT_S)
        if time.perf_counter() - since < limit and (nat is None or nat.error is None):
            return True
        why = (nat.error if nat is not None else None) or f"native sidecar not ready in {limit:.0f} s"
        self.errors.append(f"{why}: recorded without native data")
        if nat is not None:
            nat.close(kill=True)  # a sidecar stuck in its attach lets go of the job
        self.native, self.native_cfg = None, None
        return False

    def add_callback(self, cb: DoneCallback) -> None:
        with self._lock:
            self._callbacks.append(cb)

    def add_listener(self, cb: DoneCallback) -> None:
        """Call ``cb(result)`` after every capture from now on, whoever requested it (export thread)."""
        with self._lock:
            if cb not in self._listeners:
                self._listeners.append(cb)

    def poll(self) -> None:
        """Called by the control thread a few times a second: timeouts and time-based captures."""
        st = self.state
        req = self.req
        if req is None or st in (IDLE, EXPORTING):
            return
        if st == ARMED and not self._pm_prewarm_started:
            self._prewarm_pm(req)
        now = time.perf_counter()
        if self.pending_main and now - self.pending_since > START_TIMEOUT_S:
            what = self.pending_main
            if what == "start":
                self.pending_main = None
                self._fail("the main thread ran no Python code for 10 s, so a time-based capture could not start")
                return
            log.warn_once("stop-wait", "waiting for the main thread to run Python code to stop the profiler")
        if st == ARMED:
            self._maybe_launch_native()
        if st == ARMED and self._native_pending():
            return  # a time-based start waits for the sidecar too
        if st == ARMED and self.pending_main is None and req.wait_ms is not None:
            tracker = self.agent.tracker
            med = tracker.median_ms() or 0.0
            wait = max(req.wait_ms, 3 * med)  # slow iterations are not "no iterations"
            if tracker.count == self.armed_count and not self.prepared and (now - self.armed_at) * 1e3 >= wait:
                self._schedule_main("start")
        elif st == RECORDING and self.mode == "time" and self.pending_main is None:
            if (now - self.t_start) * 1e3 >= req.fallback_duration_ms:
                self._schedule_main("stop")

    def _prewarm_pm(self, req: CaptureRequest) -> None:
        """While armed: a PM sampler process builds the C side and resolves the GPU's metrics
        (cached per chip on disk; seconds the first time), so that a capture's sampler process only
        configures and starts."""
        if "hw" not in req.what or not req.hw_pm_interval_us:
            return
        dev = self.job_device
        if dev is None:
            return  # no iteration seen on a CUDA job yet: ask again at the next poll
        self._pm_prewarm_started = True

        def run() -> None:
            side = None
            try:
                from aiprof.agent.pmsidecar import PmSidecar

                t0 = time.perf_counter()
                side = PmSidecar(self._device_uuid(dev), dev, req.hw_pm_interval_us, prewarm=True)
                side.wait_ready()
                self.pm_metrics = side.metrics or None
                self.pm_prewarm_s = round(time.perf_counter() - t0, 3)
            except Exception as exc:  # every capture of this process says it, with the fallback
                self.pm_prewarm_error = str(exc) if type(exc).__name__ == "SidecarError" else f"{type(exc).__name__}: {exc}"
                log.info(f"PM sampler prewarm: {self.pm_prewarm_error}")
            finally:
                if side is not None:
                    side.close()
                self._pm_prewarmed.set()

        threading.Thread(target=run, name="aiprof-pm-prewarm", daemon=True).start()

    def _schedule_main(self, what: str) -> None:
        from aiprof.agent.mainthread import call_soon_in_main_thread

        self.pending_main = what
        self.pending_since = time.perf_counter()
        log.info(f"scheduling {what} on the main thread")
        fn = self._main_start if what == "start" else self._main_stop
        if not call_soon_in_main_thread(fn):
            self.pending_main = None
            self._fail("the interpreter refused a main-thread call (pending-call queue full)")

    # pending_main stays set until the call has finished: _start/_stop release the GIL (imports,
    # file I/O, profiler setup) and the control thread must not schedule the same thing twice
    def _main_start(self) -> None:
        if self.pending_main != "start" or self.state != ARMED:
            return  # cancelled, or an iteration boundary got there first
        log.info(f"time-based start, {time.perf_counter() - self.pending_since:.3f} s after scheduling")
        try:
            self._start(None, "time")
        finally:
            self.pending_main = None

    def _main_stop(self) -> None:
        if self.pending_main != "stop" or self.state != RECORDING:
            return
        log.info(f"time-based stop, {time.perf_counter() - self.pending_since:.3f} s after scheduling")
        try:
            self._stop()
        finally:
            self.pending_main = None

    @_holds_the_job
    def yield_to_job(self) -> None:
        """The job is about to prepare or start its own profiler (agent/profguard.py): drop this
        capture first if it holds the profiler, so that the job's runs alone."""
        if not self.finished.wait(JOB_PROFILER_WAIT_S):  # a detached profiler still holds Kineto
            log.warn_once("yield-finish", "the job started its own torch.profiler while the agent's was still "
                                          f"finishing ({JOB_PROFILER_WAIT_S:.0f} s); the two may collide")
        if not (self.state is RECORDING or (self.state is ARMED and self.prepared)):
            return
        why = "the job started its own torch.profiler; this capture was dropped so that the job's runs alone"
        if self.prof_thread != threading.get_ident():
            log.warn_once("yield-thread", f"{why.split(';')[0]} on another thread; the agent cannot stop its own "
                                          "capture from there")
            return
        rf, self.step_rf = self.step_rf, None
        try:
            if rf is not None:
                rf.__exit__(None, None, None)
            if self.state is RECORDING and self.prof is not None:
                with profguard.own():
                    self.prof.stop_trace()
        except Exception as exc:
            self.errors.append(f"profiler stop: {type(exc).__name__}: {exc}")
        self.prof = None
        self.pending_main = None
        self._fail(why)

    def _fail(self, why: str) -> None:
        if self.sampler is not None:
            self.sampler.stop_pm()
            self.sampler._stop.set()
            self.sampler = None
        with self._lock:
            self.state = IDLE
        self._finish({"ok": False, "error": why, "dir": None})

    # -- training thread ----------------------------------------------------------------------
    def step_begin(self, k: int) -> None:
        """Iteration ``k`` starts (called on the stepping thread)."""
        st = self.state
        if st is IDLE or st is EXPORTING:
            return
        req = self.req
        if req is None:
            return
        if st is ARMED:
            if self.job_device is None:
                self.job_device = job_device()
            if self.pending_main == "start":
                self.pending_main = None  # iterations appeared after all: use them
            if self.start_at is None:
                # skip counts from the iteration in progress when the request arrived
                self.start_at = req.start_at if req.start_at is not None else self.armed_count + req.skip
            if not self._ready_to_record(k, req) or self.state is not ARMED:
                return
            if self.native_cfg is not None and self._native_pending():
                return  # hooks not in yet: a later iteration starts the capture
            self._start(k, "iterations" if req.iterations is not None else "duration")
            if self.state is not RECORDING:
                return
        if self.mode == "time":
            return
        from torch.autograd.profiler import record_function

        rf = record_function(f"ProfilerStep#{k}")
        rf.__enter__()
        self.step_rf = rf
        if not self.steps:
            self.first_step_t = time.perf_counter()
        self.steps.append(k)

    @property
    def pm_ready(self) -> bool:
        """The PM sampler's library and metrics are resolved: a capture with PM counters needs only
        its set-up (PM_SETUP_LEAD_S); agents report it so that planners leave room."""
        return self._pm_prewarmed.is_set() and self.pm_prewarm_error is None

    @property
    def pm_off(self) -> bool:
        """This process would not sample PM counters now: it ran iterations without initialising
        CUDA (a CPU job), or PM sampling failed here for good; planners leave it no room
        (protocol.pm_lead_s). Before its first iteration a GPU job may not have touched CUDA yet:
        not off. Read by the status thread: torch.cuda.is_initialized() never initialises CUDA."""
        if self.pm_prewarm_error or self.pm_lasting_error:
            return True
        if self.job_device is not None or not getattr(getattr(self.agent, "tracker", None), "count", 0):
            return False
        torch = sys.modules.get("torch")
        try:
            return torch is None or not torch.cuda.is_initialized()
        except Exception:
            return True

    def _pm_wanted(self, req: CaptureRequest) -> bool:
        """The request asks for PM counters on a CUDA job whose process may sample (read once per
        capture: the hot path reads the cached answer)."""
        if self.pm_wanted is None:
            self.pm_wanted = False
            self.pm_wanted = (wants_pm(req.what, req.hw_pm_interval_us) and self.job_device is not None
                              and self.pm_lasting_error is None)
        return self.pm_wanted

    def _ready_to_record(self, k: int, req: CaptureRequest) -> bool:
        """Whether iteration ``k`` starts the recording; before it, prepare the profiler (one
        iteration ahead: CUPTI's warm-up) and, for PM counters, get the sampler running first
        (PM_READY_MAX_S, PM_SETUP_LEAD_S). Never waits: an iteration that is not ready returns."""
        assert self.start_at is not None
        pm = self._pm_wanted(req) and time.perf_counter() - self.armed_at <= PM_READY_MAX_S
        if pm and not self._pm_prewarmed.is_set():
            return False  # no profiler before the sampler's library and metrics: their CUPTI calls come first
        fixed = req.start_at is not None
        if k < self.start_at:
            lead = 1
            if pm and fixed:
                med = self.agent.tracker.median_ms() or 0.0
                lead = 1 + (int(PM_SETUP_LEAD_S * 1e3 // med) if med > 0 else 0)
            if (req.warmup or pm) and not self.prepared and k >= self.start_at - lead:
                self._prepare()
            return False
        if pm and not self.prepared:
            self._prepare()
            return False
        if pm and not fixed and self.sampler is not None and not self.sampler.pm_settled():
            return False
        if pm and fixed and k > self.start_at:
            self.info["start_delayed"] = {"asked": self.start_at, "started": k,
                                          "why": "the PM sampler's library and metrics were not ready"}
        return True

    def step_end(self, k: int) -> None:
        """Iteration ``k`` ended (called on the stepping thread)."""
        if self.state is not RECORDING or self.mode == "time":
            return
        rf, self.step_rf = self.step_rf, None
        if rf is not None:
            rf.__exit__(None, None, None)
        if not self.steps:
            return
        req = self.req
        assert req is not None
        if req.iterations is not None and self.mode == "iterations":
            done = len(self.steps) >= req.iterations
        else:
            done = (time.perf_counter() - self.first_step_t) * 1e3 >= req.fallback_duration_ms
        if done:
            self._stop()

    # -- profiler -----------------------------------------------------------------------------
    def _make_profiler(self) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile

        req = self.req
        assert req is not None
        acts = [ProfilerActivity.CPU]
        cuda = False
        try:
            cuda = bool(torch.cuda.is_initialized())  # never initialise CUDA in a CPU job
        except Exception:
            pass
        if cuda:
            acts.append(ProfilerActivity.CUDA)
            cupti_teardown.watch_graphs()  # from the first CUDA capture on: graphs rule out teardown
        self.info["activities"] = ["cpu", "cuda"] if cuda else ["cpu"]
        w = set(req.what)
        return profile(activities=acts, record_shapes="shapes" in w, with_stack="python" in w,
                       profile_memory="memory" in w, with_flops="flops" in w)

    def _start_sampler(self, gpus: list[str]) -> None:
        req = self.req
        if req is None or "hw" not in req.what:
            return
        try:
            from aiprof.agent.hwmon import HwSampler

            dev = (self.info.get("device") or {}).get("index")
            pm_us, why_not = req.hw_pm_interval_us, None
            if pm_us and dev is not None and not self._pm_prewarmed.is_set():
                # never resolved in the capture, under Kineto (PM_READY_MAX_S)
                pm_us, why_not = 0, ("its library and metrics were not ready before the capture (a time-based "
                                     f"capture, or over {PM_READY_MAX_S:.0f} s)")
            elif pm_us and dev is not None and self.pm_prewarm_error:
                pm_us, why_not = 0, f"its library and metrics could not be set up ({self.pm_prewarm_error})"
            elif pm_us and dev is not None and self.pm_lasting_error:
                pm_us, why_not = 0, f"it failed in an earlier capture of this process ({self.pm_lasting_error})"
            self.sampler = HwSampler(req.hw_interval_ms, gpus, pm_us, dev, pm_not_run=why_not, pm_metrics=self.pm_metrics)
            self.sampler.start()
        except Exception as exc:
            self.errors.append(f"hw sampler: {type(exc).__name__}: {exc}")

    @_holds_the_job
    def _prepare(self) -> None:
        why = profguard.busy()
        if why:
            self._fail(why)
            return
        # the unprofiled iterations end here: from now the profiler's set-up (CUPTI's warm-up) and its
        # callbacks run in the iterations (the last of before_ms before: its slowest in 67 of 72 v3 captures)
        self.before_ms = self.agent.tracker.recent_ms(50)
        try:
            self._start_sampler(self._gpu_uuids())
            self.prof = self._make_profiler()
            with profguard.own():
                self.prof.prepare_trace()
            self._profiler_ready()
            self.prepared = True
            self.prof_thread = threading.get_ident()
        except Exception as exc:
            self.prof = None
            self._fail(f"profiler prepare failed: {type(exc).__name__}: {exc}")

    @_holds_the_job
    def _start(self, k: int | None, mode: str) -> None:
        req = self.req
        assert req is not None
        why = profguard.busy()
        if why:
            self.prof = None
            self._fail(why)
            return
        try:
            self.mode = mode
            tracker = self.agent.tracker
            if not (self.prepared and self.before_ms):  # prepared ahead: its iterations are not unprofiled
                self.before_ms = tracker.recent_ms(50)
            self.info.update(rank_info())
            self.info["thread"] = threading.current_thread().name
            gpus = self._gpu_uuids()
            if self.sampler is None:  # start sampling just before recording (setup is slow)
                self._start_sampler(gpus)
            with profguard.own():
                if self.prof is None:
                    self.prof = self._make_profiler()
                    self.prof.prepare_trace()
                if self.native is not None:  # one pipe write; the sidecar keeps calls from now on
                    self.native_recording = self.native.start_recording(time.time_ns())
                self.prof.start_trace()
            self._profiler_ready()
            self.prof_thread = threading.get_ident()
            from torch.autograd.profiler import record_function

            self.clock = clock_marker(record_function)
            self.t_start = time.perf_counter()
            self.t_start_unix_ns = self.clock["marker_unix_ns"][0]
            # read while the job's process group is alive: the meta is written later, off the
            # training thread, maybe after the job's destroy_process_group()
            self.info["communication"] = comm_settings()
            self.state = RECORDING
        except Exception as exc:
            self.prof = None
            self._fail(f"profiler start failed: {type(exc).__name__}: {exc}")

    def _profiler_ready(self) -> None:
        """Kineto has set CUPTI up (and its timestamp callback): PM sampling may configure now."""
        if self.sampler is not None:
            self.sampler.profiler_ready.set()

    def _gpu_uuids(self) -> list[str]:
        """NVML UUID of the job's CUDA device (this stepping thread's current one), if CUDA is in use."""
        try:
            import torch

            if not torch.cuda.is_initialized():
                return []
            dev = torch.cuda.current_device()
            self.job_device = dev
            self.info["device"] = {"index": dev, "name": torch.cuda.get_device_properties(dev).name}
            uuid = self._device_uuid(dev)
            return [uuid] if uuid else []
        except Exception as exc:
            self.errors.append(f"GPU id: {type(exc).__name__}: {exc}")
            return []

    @staticmethod
    def _device_uuid(dev: int) -> str | None:
        """``GPU-…`` UUID of the job's CUDA device ``dev`` (CUDA initialised by the job), or None."""
        try:
            import torch

            if not torch.cuda.is_initialized():
                return None
            uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", "") or "")
        except Exception:
            return None
        return (uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid) if uuid else None

    @_holds_the_job
    def _stop(self) -> None:
        """Stop the profiler (stepping or main thread) and hand the results to the exporter."""
        t_stop_unix_ns = time.time_ns()
        try:
            rf, self.step_rf = self.step_rf, None
            if rf is not None:
                rf.__exit__(None, None, None)
            if self.sampler is not None:
                # PM sampling stops with the recording, before the profiler's stop
                # (only where it can have started: a CPU job's Python trace keeps no agent frame)
                if self.sampler.pm_interval_us and self.sampler.cuda_index is not None:
                    self.sampler.stop_pm()
                self.sampler._stop.set()  # joined by the exporter, not here
            if "cuda" in (self.info.get("activities") or ()):
                # CUPTI detached at stop, else the job's CUDA calls stay slower (cupti_teardown.py)
                self.info["cupti_teardown"] = cupti_teardown.decide()
            t0 = time.perf_counter()
            self.info["stop"] = self._detach()
            if self.detached is None:
                with profguard.own():
                    self.prof.stop_trace()
            self.info["stop_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        except Exception as exc:
            self.errors.append(f"profiler stop: {type(exc).__name__}: {exc}")
        self.during_ms = self.agent.tracker.recent_ms(len(self.steps)) if self.steps else []
        self.info["stopped_unix_ns"] = t_stop_unix_ns
        self.info["recorded_s"] = round(time.perf_counter() - self.t_start, 6)
        with self._lock:
            self.state = EXPORTING
        self.export_thread = threading.Thread(target=self._export, name="aiprof-export", daemon=True)
        self.export_thread.start()

    def _detach(self) -> dict[str, Any]:
        """Detach the profiler from this thread (agent/offstop.py) so the export thread finishes
        it; on any failure the caller stops it here the old way. Returns how, for meta.json."""
        if os.environ.get(OFFSTOP_ENV, "1") == "0":
            return {"how": "stop_trace", "why": f"{OFFSTOP_ENV}=0"}
        lib = offstop.ready()
        if lib is None:
            return {"how": "stop_trace", "why": offstop.unavailable() or "the stopper was still building"}
        if self.prof_thread != threading.get_ident():
            return {"how": "stop_trace", "why": "stopped on another thread than the one that started it"}
        try:
            self.finished.clear()
            self.detached = offstop.detach(lib)
        except offstop.OffstopError as exc:
            self.finished.set()
            return {"how": "stop_trace", "why": f"detach failed: {exc}"}
        offstop.mark_stopped(self.prof)
        return {"how": "detached", "detached_unix_ns": time.time_ns()}

    # -- export (background thread) -----------------------------------------------------------
    def out_dir(self) -> str:
        req = self.req
        assert req is not None
        return os.path.join(req.out, req.capture_id, f"rank{self.info.get('rank', 0)}")

    def _export(self) -> None:
        result: dict[str, Any] = {"ok": False, "dir": None, "error": None}
        try:
            req = self.req
            assert req is not None
            d = self.out_dir()
            os.makedirs(d, exist_ok=True)
            result["dir"] = d
            trace_bytes = 0
            if self.prof is not None:
                from aiprof.agent.traceout import finish_detached, release_results, write_trace

                try:
                    if self.detached is not None:
                        handle, self.detached = self.detached, None
                        cuda_dev = (self.info.get("device") or {}).get("index") \
                            if "cuda" in (self.info.get("activities") or ()) else None
                        try:
                            out = finish_detached(offstop.ready(), handle, d, req.max_trace_mb << 20,
                                                  self.clock.get("marker_name", CLOCK_MARKER), cuda_dev)
                        finally:
                            self.finished.set()
                    else:
                        out = write_trace(self.prof, d, req.max_trace_mb << 20,
                                          self.clock.get("marker_name", CLOCK_MARKER), self.info.get("stop_ms"))
                finally:
                    t0 = time.perf_counter()
                    release_results(self.prof)  # holds the GIL as long as it takes: timed, for the record
                    self.prof = None
                    release_ms = round((time.perf_counter() - t0) * 1e3, 3)
                trace_bytes = out.pop("trace_bytes")
                self._clock_offset(out.pop("marker_ts"), out.pop("base_time_ns", None))
                self.info["export"] = {**out, "release_ms": release_ms}
            hw_rows = 0
            hw_notes: list[str] = []
            hw_sources: list[str] = []
            if self.sampler is not None:
                samples = self.sampler.stop()
                off = self.clock.get("trace_minus_unix_us", 0.0) or 0.0
                from aiprof.agent.hwmon import write_csv

                hw_rows = write_csv(os.path.join(d, "hw.csv"), samples, off)
                hw_notes, hw_sources = self.sampler.notes, self.sampler.sources
                self.pm_meta = dict(self.sampler.pm_status)
                if self.pm_meta.get("lasting") and self.pm_lasting_error is None:
                    self.pm_lasting_error = str(self.pm_meta.get("error"))  # later captures skip PM, saying why
                if self.pm_meta.get("asked"):
                    self.pm_meta["prewarm_s"] = self.pm_prewarm_s
                pm = self.sampler.pm_samples
                if pm is not None and len(pm.t0):
                    from aiprof.agent.hwmon import PM_FILE, write_pm_csv

                    label = f"gpu{(self.info.get('device') or {}).get('index', 0)}"
                    self.pm_meta.update(write_pm_csv(os.path.join(d, PM_FILE), pm, off, label))
                elif self.pm_meta.get("ok"):
                    self.pm_meta["rows"] = 0
                self.sampler = None
            native = self._export_native(d)
            meta = self._meta(trace_bytes, hw_rows, hw_sources, hw_notes)
            if native is not None:
                meta["native"] = native
                meta["files"].update({k: v for k, v in (native.get("files") or {}).items()})
            tmp = os.path.join(d, "meta.json.tmp")
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1, default=str)
            os.replace(tmp, os.path.join(d, "meta.json"))
            result["ok"] = True
            result["steps"] = meta["steps"]["captured"]
        except Exception as exc:
            self._drop_detached()
            self.prof = None
            why = str(exc) if type(exc).__name__ == "ExportError" else f"{type(exc).__name__}: {exc}"
            result["error"] = f"export failed: {why}"
            for leftover in ("trace.json.tmp", "trace.json.gz", "hw.csv", "pm.csv.gz", "meta.json.tmp"):
                try:
                    if result["dir"] and not result.get("ok"):
                        os.unlink(os.path.join(result["dir"], leftover))
                except OSError:
                    pass
        with self._lock:
            self.state = IDLE
            self.captures_done += 1
        self._finish(result)

    def _drop_detached(self) -> None:
        """A detached profiler whose export failed early is still recording: end it, writing nothing."""
        handle, self.detached = self.detached, None
        if handle is not None:
            try:
                offstop.finish(offstop.ready(), handle, "")
            except Exception as exc:
                self.errors.append(f"profiler finish: {type(exc).__name__}: {exc}")
            finally:
                self.finished.set()

    def _export_native(self, d: str) -> dict[str, Any] | None:
        """The sidecar's files for this capture (calls.csv, syscalls.csv, native.folded), on the
        trace clock; None when the request asked for nothing native."""
        if self.req is None or self.req.native_config() is None:
            return None
        nat, recording = self.native, self.native_recording
        self.native_recording = False
        if nat is None or not recording:
            return {"files": {}, "notes": [e for e in self.errors if "native" in e] or ["native sidecar not running"]}
        window = [self.t_start_unix_ns, self.info.get("stopped_unix_ns") or time.time_ns()]
        off = self.clock.get("trace_minus_unix_us")
        if off is None:
            return {"files": {}, "notes": ["no clock offset: native data not placed on the trace clock"]}
        res = nat.finish(d, window, float(off))
        res["ready"] = {k: v for k, v in (nat.ready or {}).items() if k != "event"}
        return res

    def _clock_offset(self, ts: float | None, base_ns: int | None = None) -> None:
        """Record trace_ts - unix_us in self.clock (see :func:`trace_offset`)."""
        try:
            if ts is None:
                self.errors.append("clock marker not found in trace")
                return
            self.clock.update(trace_offset(ts, self.clock["marker_unix_ns"],
                                           self.clock.get("marker_name", CLOCK_MARKER), base_ns))
        except Exception as exc:
            self.errors.append(f"clock offset: {type(exc).__name__}: {exc}")

    def _versions(self) -> dict[str, Any]:
        v: dict[str, Any] = {"python": platform.python_version()}
        try:
            import aiprof

            v["aiprof"] = aiprof.__version__
        except Exception:
            pass
        torch = sys.modules.get("torch")
        if torch is not None:
            v["torch"] = getattr(torch, "__version__", None)
            v["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
            try:
                if torch.cuda.is_initialized():
                    v["cudnn"] = torch.backends.cudnn.version()
                    v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:
                pass
        pynvml = sys.modules.get("pynvml")
        if pynvml is not None:
            try:
                pynvml.nvmlInit()
                drv = pynvml.nvmlSystemGetDriverVersion()
                v["driver"] = drv.decode() if isinstance(drv, bytes) else drv
            except Exception:
                pass
        return v

    def _meta(self, trace_bytes: int, hw_rows: int, hw_sources: list[str], hw_notes: list[str]) -> dict[str, Any]:
        req = self.req
        assert req is not None
        tracker = self.agent.tracker
        before = self.before_ms
        srt = sorted(before)
        during = getattr(self, "during_ms", [])
        return {
            "schema": META_SCHEMA,
            "capture_id": req.capture_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "rank": self.info.get("rank", 0),
            "world_size": self.info.get("world_size", 1),
            "local_rank": self.info.get("local_rank"),
            "cmdline": list(getattr(sys, "orig_argv", sys.argv)),
            "cwd": os.getcwd(),
            "origin": getattr(self.agent, "origin", "?"),
            "trigger": req.trigger or {"reason": "request"},  # auto-trigger: why it captured
            "mode": self.mode,  # iterations | duration (steps seen) | time (no steps: main thread)
            "options": req.to_dict(),
            "activities": self.info.get("activities"),
            "cupti_teardown": self.info.get("cupti_teardown"),  # CUDA captures: CUPTI detached at stop?
            "stop": self.info.get("stop"),  # how the profiler was stopped (off the training thread?)
            "device": self.info.get("device"),
            "thread": self.info.get("thread"),
            "started_unix_ns": self.t_start_unix_ns,
            "start_delayed": self.info.get("start_delayed"),  # fixed iterations started later: why
            "stopped_unix_ns": self.info.get("stopped_unix_ns"),
            "recorded_s": self.info.get("recorded_s"),
            "steps": {
                "source": tracker.source,
                "captured": self.steps,
                "annotation": "ProfilerStep#<k>",
                "before_ms": before,
                "before_median_ms": srt[len(srt) // 2] if srt else None,
                "during_ms": during,
                "seen_total": tracker.count,
            },
            "clock": self.clock,
            "versions": self._versions(),
            # NCCL/torch distributed settings the job ran with (agent/commsettings.py)
            "communication": self.info.get("communication") or comm_settings(),
            "files": {"trace": "trace.json.gz", "hw": "hw.csv" if hw_rows else None,
                      "pm": (getattr(self, "pm_meta", None) or {}).get("file")},
            "trace_json_bytes": trace_bytes,
            "hw": {"rows": hw_rows, "sources": hw_sources, "notes": hw_notes, "interval_ms": req.hw_interval_ms,
                   "pm": getattr(self, "pm_meta", None)},
            # what the end of the capture cost: stop_ms on the training thread, the rest off it
            "export": {"stop_ms": self.info.get("stop_ms"), **(self.info.get("export") or {})},
            "errors": self.errors,
        }

    def _finish(self, result: dict) -> None:
        self.last_result = result
        with self._lock:
            cbs, self._callbacks = self._callbacks + self._listeners, []
        for cb in cbs:
            try:
                cb(result)
            except Exception as exc:
                log.error("capture callback", exc)
        if not result.get("ok"):
            log.warn_once(f"capture-fail-{self.captures_done}", f"capture failed: {result.get('error')}")

    # -- shutdown -----------------------------------------------------------------------------
    def _say_pm_wait_at_exit(self) -> None:
        """The job ends while a capture it reached waits for its PM sampler (the first one on a
        machine compiles and resolves for ~10 s): say so, or `aiprof run` can only guess that
        fewer iterations ran."""
        req = self.req
        if req is None or self.start_at is None or self.agent.tracker.count < self.start_at or not self.pm_wanted:
            return
        waited = time.perf_counter() - self.armed_at
        log.warn_once("pm-wait-exit", f"the job ended while its capture waited {waited:.1f} s for the GPU counters' "
                                      "sampler to start (PM sampling, on by default under --what hw); "
                                      "--hw-pm-interval-us 0 records without waiting")

    def at_exit(self) -> None:
        """Interpreter exit: stop a capture in flight (main thread) and wait for its export."""
        try:
            if self.state == RECORDING and threading.current_thread() is threading.main_thread():
                self.errors.append("the job exited during the capture")
                self._stop()
            elif self.state == ARMED:
                self._say_pm_wait_at_exit()
            t = self.export_thread
            if t is not None and t.is_alive():
                t.join(EXPORT_WAIT_AT_EXIT_S)
            if self.native is not None:
                self.native.close()
        except Exception as exc:
            log.error("capture at exit", exc)
