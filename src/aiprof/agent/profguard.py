"""The job's own torch.profiler comes first: the agent never records alongside it.

Two Kineto sessions in one process break each other: the job's trace gets every event twice,
torch warns "disableProfiler called but no active profiling session found", and the job's own
stop or export can crash the process (seen with torch 2.13 on CPU: SIGSEGV). So:

- while a profiler of the job is prepared or recording, the agent does not prepare or start a
  capture (it fails with that reason, :func:`busy`);
- when the job prepares or starts its own profiler while an agent capture is prepared or
  recording, the agent drops its capture first (on that thread), then the job's call proceeds.

The job's profilers are seen by wrapping three methods of ``torch.autograd.profiler.profile``,
which both ``torch.profiler.profile`` and the ``with profile():`` form go through:
``_prepare_trace``, ``_start_trace`` (seen: the profiler is live) and ``__exit__`` (gone). The
agent's own calls run inside :func:`own` and are not counted. Nothing here raises into the job.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

from aiprof.agent import log

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the job's profilers prepared or started, not exited
_local = threading.local()
_on_job_profiler: Callable[[], None] | None = None


@contextlib.contextmanager
def own() -> Iterator[None]:
    """Mark the calls inside as the agent's own profiler calls (not the job's)."""
    prev = getattr(_local, "own", False)
    _local.own = True
    try:
        yield
    finally:
        _local.own = prev


def busy() -> str | None:
    """Why the agent must not prepare or start a capture now, or None."""
    if len(_live):
        return "the job's own torch.profiler is in use; the agent does not record alongside it"
    try:
        torch = sys.modules.get("torch")
        if torch is not None and torch._C._autograd._profiler_enabled():
            return (f"{_active_profiler(torch)} is already on in the job; the agent does not record alongside it "
                    "(turn it off to capture)")
    except Exception:
        pass
    return None


# What each autograd-profiler mode is, as a user turns it on (torch's ActiveProfilerType names).
_PROFILER_KINDS = {
    "NVTX": "torch.autograd.profiler.emit_nvtx() (an NVTX range per op, for Nsight Systems)",
    "ITT": "torch.autograd.profiler.emit_itt() (an ITT range per op, for Intel VTune)",
    "LEGACY": "the legacy torch.autograd.profiler.profile(use_kineto=False)",
    "KINETO": "a torch.profiler / torch.autograd.profiler.profile session",
}


def _active_profiler(torch: Any) -> str:
    """The autograd profiler mode on in this thread, named as users turn it on."""
    try:
        kind = str(torch._C._autograd._profiler_type()).rsplit(".", 1)[-1]
    except Exception:  # an older torch: no type to read
        kind = ""
    return _PROFILER_KINDS.get(kind, "a profiler")


def _job_call(obj: Any) -> None:
    if getattr(_local, "own", False):
        return
    try:
        _live.add(obj)
        if _on_job_profiler is not None:
            _on_job_profiler()
    except Exception as exc:  # the job's profiler call must go ahead whatever happened here
        log.error("profiler guard", exc)


def install(on_job_profiler: Callable[[], None]) -> bool:
    """Wrap the profiler's methods (once per process); ``on_job_profiler()`` is called on the
    job's thread just before its profiler is prepared or started. Returns False when the
    methods are not there (another torch version): then only :func:`busy`'s check remains."""
    global _on_job_profiler
    _on_job_profiler = on_job_profiler
    try:
        from torch.autograd import profiler as ap

        cls = ap.profile
        if getattr(cls, "__aiprof_guarded__", False):
            return True
        names = ("_prepare_trace", "_start_trace", "__exit__")
        if not all(callable(getattr(cls, n, None)) for n in names):
            log.info("profiler guard: torch.autograd.profiler.profile has no _prepare_trace/_start_trace")
            return False

        def entering(orig: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(orig)
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                _job_call(self)
                return orig(self, *args, **kwargs)
            return wrapper

        exit_orig = cls.__exit__

        @functools.wraps(exit_orig)
        def exiting(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return exit_orig(self, *args, **kwargs)
            finally:
                _live.discard(self)

        cls._prepare_trace = entering(cls._prepare_trace)
        cls._start_trace = entering(cls._start_trace)
        cls.__exit__ = exiting
        cls.__aiprof_guarded__ = True
        return True
    except Exception as exc:
        log.error("profiler guard install", exc)
        return False
