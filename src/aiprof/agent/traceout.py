"""Writing a stopped profiler's trace (trace.json.gz) without holding up the training thread.

The shipped path finishes a profiler the training thread detached (:func:`finish_detached`,
agent/offstop.py): Kineto's post-processing and save run on the export thread with the GIL
released. What follows is the fallback, for a profiler stopped with torch's ``stop_trace``.

torch's ``export_chrome_trace`` (Kineto's ``save``) and the release of the profiler's results
are C++ calls that hold the GIL from start to end, during which the training thread cannot run
a line of Python, whichever thread makes the call. A forked child can write instead: a copy of
this process that has the results in its memory writes the JSON, finds the clock marker, gzips
and exits with ``os._exit`` (it never touches CUDA, runs no atexit handler, takes no lock
another thread may have held). The parent's export thread waits for it in ``select`` (no GIL);
a child whose files stop growing for :data:`CHILD_STALL_S` is killed (the capture fails, the
job goes on). The child dies with its parent (``PR_SET_PDEATHSIG``) and runs at nice 10.

A fork is not free either: ``os.fork`` holds the GIL while it copies the page tables (about
25 ms per GB of anonymous memory on this project's VMs), every page the job writes while the
child lives is copied, and the child needs a core. So by default (``AIPROF_EXPORT_FORK=auto``)
the agent forks only when the trace is large enough for the save to cost more: Kineto's
``stop_trace`` time on the training thread, which grows with the trace as the save does, is
the estimate (:func:`choose_fork`). ``AIPROF_EXPORT_FORK=1`` always forks, ``0`` never; where
``os.fork`` fails (memory, process limit) the trace is written on the export thread. The
decision and its inputs go into meta.json (``export``). Standard library only.
"""
from __future__ import annotations

import ctypes
import gzip
import json
import os
import re
import select
import signal
import time
import warnings
from typing import Any

# 0: leave CUPTI recording until torch's disableProfiler stops it (after its op post-processing)
CUPTI_FIRST_ENV = "AIPROF_OFFSTOP_CUPTI_FIRST"
FORK_ENV = "AIPROF_EXPORT_FORK"  # auto (default) | 1: always fork | 0: write on the export thread
# auto: the save costs about as much GIL time as Kineto's stop_trace (CPU, torch 2.13: save 90-120 ms
# after a 114-190 ms stop), so fork when that estimate is at least FORK_GAIN x the fork's own cost
FORK_GAIN = 2.0
FORK_MIN_STOP_MS = 50.0  # below this a save is tens of ms: cheaper than any fork with its page copies
FORK_MS_PER_GB = 25.0  # os.fork's page-table copy, per GB of anonymous memory (this project's 2-core VM)
FORK_MIN_CPUS = 2  # the writer needs a core of its own; on one core it would only take turns with the job
CHILD_STALL_S = 60.0  # the child's files did not grow for this long: it is stuck (killed, capture fails)
CHILD_MAX_S = 1800.0  # a 512 MB compressed trace takes minutes at most; beyond this it is killed
CHILD_NICE = 10  # the writer yields the CPU to the job's own threads and data loaders
POLL_S = 0.25
RESULT_MAX = 1 << 16  # bytes of the child's one-line JSON answer
TAIL_BYTES = 64
PR_SET_PDEATHSIG = 1
try:  # looked up now: the child must not dlopen (a lock another thread may have held at fork)
    _prctl: Any = ctypes.CDLL(None).prctl
except Exception:
    _prctl = None

# os.fork in a threaded process warns (3.12+); the child here runs no Python that needs another thread
warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning,
                        module=__name__)


class ExportError(Exception):
    """The trace could not be written (the message says why; the job is not affected)."""


def find_marker_ts(path: str, name: str, limit_bytes: int = 1 << 30) -> float | None:
    """The ``ts`` of the first event named ``name`` in a Kineto JSON file, scanning as text.

    Kineto writes ``name`` before ``ts`` inside one event object; parsing the whole trace would
    cost memory for nothing.
    """
    pat = re.compile(rb'"name":\s*"' + re.escape(name.encode()) + rb'"[^{}]*?"ts":\s*([0-9.eE+-]+)')
    tail = b""
    read = 0
    with open(path, "rb") as f:
        while read < limit_bytes:
            chunk = f.read(1 << 22)
            if not chunk:
                break
            read += len(chunk)
            buf = tail + chunk
            m = pat.search(buf)
            if m:
                return float(m.group(1))
            tail = buf[-4096:]
    return None


# Kineto (and torch's own writer) put the trace's header, baseTimeNanoseconds in it, before the
# events; a header with one entry per GPU of a large node stays far below this.
HEADER_BYTES = 1 << 20
_BASE_RE = re.compile(rb'"baseTimeNanoseconds":\s*([0-9]+)')


def find_base_time_ns(path: str) -> int | None:
    """The trace's ``baseTimeNanoseconds`` (its events' ts are µs since this Unix time), read from
    the JSON file's header; None when it has none."""
    with open(path, "rb") as f:
        m = _BASE_RE.search(f.read(HEADER_BYTES))
    return int(m.group(1)) if m else None


def _complete_json(path: str) -> bool:
    """Whether the JSON file ends like a whole object: Kineto's writer fails silently on a full
    disk or a file size limit (RLIMIT_FSIZE), leaving a truncated file behind."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
        return f.read().rstrip().endswith(b"}")


def anon_rss_gb() -> float:
    """Resident anonymous memory of this process in GB (what os.fork copies page tables for)."""
    try:
        with open("/proc/self/statm") as f:
            _, resident, shared = (int(x) for x in f.read().split()[:3])
        return max(0, resident - shared) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return 0.0


def choose_fork(stop_ms: float | None, setting: str | None = None) -> tuple[bool, str]:
    """Whether to write the trace in a forked child, and why (see the module doc)."""
    setting = (os.environ.get(FORK_ENV, "auto") if setting is None else setting).strip().lower()
    if not hasattr(os, "fork"):
        return False, "no fork on this platform"
    if setting in ("0", "no", "off", "false"):
        return False, f"{FORK_ENV}={setting}"
    if setting in ("1", "yes", "on", "true"):
        return True, f"{FORK_ENV}={setting}"
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if cpus < FORK_MIN_CPUS:
        return False, f"{cpus} CPUs: no core to spare for a writer"
    stop = stop_ms or 0.0
    fork_ms = anon_rss_gb() * FORK_MS_PER_GB
    if stop < FORK_MIN_STOP_MS or stop < FORK_GAIN * fork_ms:
        return False, f"stop_trace {stop:.0f} ms: a small trace, cheaper to write here than a fork (~{fork_ms:.0f} ms)"
    return True, f"stop_trace {stop:.0f} ms: a large trace; a fork costs ~{fork_ms:.0f} ms"


def write_trace(prof: Any, d: str, cap_bytes: int, marker: str, stop_ms: float | None = None) -> dict[str, Any]:
    """Write ``prof``'s trace as ``d/trace.json.gz`` (at most ``cap_bytes`` compressed).

    ``stop_ms``: how long the training thread's ``stop_trace`` took (the size estimate). Returns
    ``trace_bytes`` (JSON size), ``marker_ts`` (the ``marker`` event's ts or None),
    ``base_time_ns`` (the trace's baseTimeNanoseconds or None), ``how``
    ("fork" or "thread"), ``why`` and timings in ms. Raises ExportError; leaves no partial file.
    """
    raw, gz = os.path.join(d, "trace.json.tmp"), os.path.join(d, "trace.json.gz")
    try:
        fork, why = choose_fork(stop_ms)
        if fork:
            try:
                return {**_in_child(prof, raw, gz, cap_bytes, marker), "why": why}
            except _NoFork as exc:
                why = str(exc)
        t0 = time.perf_counter()
        out = _write(prof, raw, gz, cap_bytes, marker)
        return {**out, "how": "thread", "why": why, "write_ms": round((time.perf_counter() - t0) * 1e3, 3)}
    except BaseException:
        _remove(raw, raw + ".tmp", gz)
        raise


def _remove(*paths: str) -> None:
    """Delete what a failed write left (no partial trace stays behind)."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def release_results(prof: Any) -> None:
    """Free the profiler's results now, on this thread (not in a later gc pass on the job's).

    The release holds the GIL for as long as it takes (C++ destructors): the caller times it.
    """
    inner = getattr(prof, "profiler", None)
    if inner is not None and getattr(inner, "kineto_results", None) is not None:
        inner.kineto_results = None


def finish_detached(lib: Any, handle: int, d: str, cap_bytes: int, marker: str,
                    cuda_device: int | None) -> dict[str, Any]:
    """Finish a profiler the training thread detached (agent/offstop.py) and write its trace as
    ``d/trace.json.gz``, on this (export) thread with the GIL released for all of Kineto's work.

    ``cuda_device``: wait for that GPU first, so the captured steps' last kernels have completed
    when CUPTI's buffers are flushed (this thread waits; the job does not). Returns what
    :func:`write_trace` does, ``how`` = "offthread", with ``sync_ms`` and ``finish_ms``.
    Raises ExportError; leaves no partial file.
    """
    from aiprof.agent import cupti_teardown, offstop

    raw, gz = os.path.join(d, "trace.json.tmp"), os.path.join(d, "trace.json.gz")
    try:
        t0 = time.perf_counter()
        if cuda_device is not None:
            try:
                import torch

                torch.cuda.synchronize(cuda_device)
            except Exception:  # noqa: S110 - the finish must run whatever: a profiler left detached records on
                pass
        t1 = time.perf_counter()
        early = cuda_device is not None and os.environ.get(CUPTI_FIRST_ENV, "1") != "0"
        teardown = cuda_device is not None and cupti_teardown.pending()
        before = cupti_teardown.threads_now() if teardown else None
        try:
            offstop.finish(lib, handle, raw, cupti_first=early)
        except offstop.OffstopError as exc:
            raise ExportError(f"finishing the profiler failed: {exc}") from None
        # Kineto's CUPTI teardown waits for a CUDA call: make it here, or a job that ends now hangs
        finalized = cupti_teardown.finalize(cuda_device, before) if teardown and cuda_device is not None else None
        t2 = time.perf_counter()
        out = _compress(raw, gz, cap_bytes, marker)
        return {**out, "how": "offthread", "why": "the training thread detached the profiler; finished here",
                "cupti_first": early, "cupti_finalize": finalized,
                "sync_ms": round((t1 - t0) * 1e3, 3), "finish_ms": round((t2 - t1) * 1e3, 3),
                "write_ms": round((time.perf_counter() - t2) * 1e3, 3)}
    except BaseException:
        _remove(raw, raw + ".tmp", gz)
        raise


def _write(prof: Any, raw: str, gz: str, cap_bytes: int, marker: str) -> dict[str, Any]:
    prof.export_chrome_trace(raw)  # Kineto writes raw + ".tmp", renamed to raw once complete
    return _compress(raw, gz, cap_bytes, marker)


def _compress(raw: str, gz: str, cap_bytes: int, marker: str) -> dict[str, Any]:
    """Gzip Kineto's JSON ``raw`` into ``gz`` (at most ``cap_bytes``), find the clock marker,
    remove ``raw``. Returns ``trace_bytes``, ``marker_ts`` and ``base_time_ns``."""
    if not os.path.exists(raw) or not _complete_json(raw):
        raise ExportError("Kineto could not write the whole trace JSON (disk full or a file size limit?)")
    n = os.path.getsize(raw)
    ts = find_marker_ts(raw, marker)
    base_ns = find_base_time_ns(raw)
    with open(raw, "rb") as src, open(gz, "wb") as f:
        sink = _Counted(f)
        with gzip.GzipFile(filename="", mode="wb", compresslevel=3, fileobj=sink) as dst:  # type: ignore[arg-type]
            while True:
                chunk = src.read(1 << 22)
                if not chunk:
                    break
                dst.write(chunk)
                if sink.n > cap_bytes:
                    raise ExportError(f"trace exceeds --max-trace-mb {cap_bytes >> 20}")
    os.unlink(raw)
    return {"trace_bytes": n, "marker_ts": ts, "base_time_ns": base_ns}


class _Counted:
    """A write-only file that counts the bytes through it (the output need not be seekable)."""

    def __init__(self, f: Any) -> None:
        self.f, self.n = f, 0

    def write(self, b: Any) -> int:
        self.n += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


class _NoFork(Exception):
    """fork() failed (memory, process limit): write on the export thread instead."""


def _in_child(prof: Any, raw: str, gz: str, cap_bytes: int, marker: str) -> dict[str, Any]:
    r, w = os.pipe()
    parent = os.getpid()
    t0 = time.perf_counter()
    try:
        pid = os.fork()
    except (OSError, RuntimeError) as exc:  # no memory, process limit; RuntimeError: interpreter finalizing
        os.close(r)
        os.close(w)
        raise _NoFork(f"fork failed ({getattr(exc, 'strerror', None) or exc}): written here") from None
    if pid == 0:  # the child: never returns
        _child(prof, raw, gz, cap_bytes, marker, r, w, parent)
    fork_ms = (time.perf_counter() - t0) * 1e3
    os.close(w)
    try:
        msg, status = _wait(pid, r, (raw, gz))
    finally:
        os.close(r)
    total_ms = (time.perf_counter() - t0) * 1e3
    if not msg:
        why = (f"killed by signal {os.WTERMSIG(status)}" if status is not None and os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}" if status is not None else "no answer")
        raise ExportError(f"the trace writer (pid {pid}) ended without writing the trace: {why}")
    if not msg.get("ok"):
        raise ExportError(str(msg.get("error")))
    return {"trace_bytes": msg["trace_bytes"], "marker_ts": msg["marker_ts"],
            "base_time_ns": msg.get("base_time_ns"), "how": "fork", "pid": pid,
            "fork_ms": round(fork_ms, 3), "write_ms": round(total_ms - fork_ms, 3)}


def _child(prof: Any, raw: str, gz: str, cap_bytes: int, marker: str, r: int, w: int, parent: int) -> None:
    code = 1
    try:
        os.close(r)
        for sig in (signal.SIGINT, signal.SIGTERM):  # not the job's handlers: they are for the job
            signal.signal(sig, signal.SIG_DFL)
        try:
            if _prctl is not None:
                _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
            os.nice(CHILD_NICE)
        except Exception:
            pass
        if os.getppid() != parent:  # the job died before the death signal was armed
            return
        out = _write(prof, raw, gz, cap_bytes, marker)
        os.write(w, json.dumps({"ok": True, **out}).encode())
        code = 0
    except BaseException as exc:
        try:
            why = str(exc) if isinstance(exc, ExportError) else f"{type(exc).__name__}: {exc}"
            os.write(w, json.dumps({"ok": False, "error": why[:4000]}).encode())
        except BaseException:
            pass
    finally:
        os._exit(code)


def _wait(pid: int, r: int, files: tuple[str, ...]) -> tuple[dict | None, int | None]:
    """The child's answer and exit status; kills a child that stopped making progress."""
    buf = b""
    start = last_change = time.monotonic()
    last_size = -1
    while True:
        ready, _, _ = select.select([r], [], [], POLL_S)
        if ready:
            chunk = os.read(r, RESULT_MAX)
            if not chunk:
                break  # the child closed its end: it is exiting
            buf = (buf + chunk)[:RESULT_MAX]
            continue
        now = time.monotonic()
        size = sum(os.path.getsize(p) for p in files if os.path.exists(p))
        if size != last_size:
            last_size, last_change = size, now
        elif now - last_change > CHILD_STALL_S or now - start > CHILD_MAX_S:
            _kill(pid)
            raise ExportError(f"the trace writer (pid {pid}) made no progress for {now - last_change:.0f} s; stopped it")
    status = _reap(pid)
    try:
        msg = json.loads(buf) if buf else None
    except ValueError:
        msg = None
    return (msg if isinstance(msg, dict) else None), status


def _reap(pid: int) -> int | None:
    """The child's wait status (it closed the pipe, so it is exiting); None if someone else reaped it."""
    deadline = time.monotonic() + CHILD_STALL_S
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # SIGCHLD ignored, or the job reaps every child itself
            return None
        if got == pid:
            return status
        if time.monotonic() > deadline:
            _kill(pid)
            return None
        time.sleep(0.01)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (OSError, ChildProcessError):
        pass
