"""Ending a torch.profiler capture off the training thread (offstop.cpp, built on first use).

``profile.stop()`` runs Kineto's whole post-processing (CUPTI buffers to activities, recorded
ops to events) inside one C++ call that holds the GIL, on the thread that started the
profiler: 230-370 ms of a GPT-2 step on an H100, a second on a long capture, during which
the job does nothing. Here the training thread only *detaches* the profiler (takes its state
out of the thread-local slot torch keeps it in and removes its RecordFunction callback: a few
microseconds); the export thread later *finishes* it: it puts the state into its own slot and
calls torch's ``disableProfiler()`` and ``ProfilerResult::save()``, through ctypes, which
releases the GIL, so the job runs on meanwhile.

After a detach nothing more is recorded on the training thread; CUPTI keeps recording GPU
activity until the finish disables it, so kernels launched in that gap (the job's next step)
are in the trace beyond the capture's last step: the agent records the detach time in
meta.json (``stop.detached_unix_ns``) and the store drops them (trace/clip.py). The finish stops
CUPTI's recording first (once the GPU has done the captured work), so that gap is short.

The helper is compiled once per torch build against torch's own headers and cached
(agent/cbuild.py); :func:`prepare` starts that build on a background thread when a capture is
armed. Where it cannot be built or loaded (no compiler, no headers in the torch install) the
capture stops the old way, on the training thread, and meta.json says why.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from aiprof.agent import cbuild

ERR_BYTES = 1024  # the C side's one-line error message
NAME = "offstop"
_lock = threading.Lock()
_lib: Any = None
_error: str | None = None  # why the helper is unavailable in this process (not retried)
_building: threading.Thread | None = None


class OffstopError(RuntimeError):
    """The profiler could not be detached or finished here; ``str()`` says why."""


# The C++ standard torch's own extensions build with (torch.utils.cpp_extension: C++20 since 2.x);
# torch 2.14's headers need it (std::strong_ordering in c10/util/intrusive_ptr.h: `make
# test-latest` found the C++17 build failing there).
CXX_STD = "c++20"


def _source() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "offstop.cpp")


def _plan() -> tuple[str, list[str]]:
    """The cache key and compiler arguments for the running torch."""
    import torch  # already imported by the job: the agent runs only in torch processes

    root = os.path.dirname(os.path.abspath(torch.__file__))
    lib_dir = os.path.join(root, "lib")
    # what torch.utils.cpp_extension.include_paths() gives, without importing it (setuptools...)
    incs = [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include")]
    if not os.path.isfile(os.path.join(incs[0], "torch", "csrc", "autograd", "profiler_kineto.h")):
        raise cbuild.BuildError("torch's C++ headers are not installed (torch/include)")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    # the torch build is part of the key: the helper calls its C++ ABI directly
    key = cbuild.digest([_source()], [torch.__version__, lib_dir, str(abi), CXX_STD])
    args = ["-x", "c++", "-shared", "-fPIC", "-O1", "-w", f"-std={CXX_STD}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            _source(), *(f"-I{d}" for d in incs), f"-L{lib_dir}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib_dir}"]
    return key, args


def build() -> str:
    """Compile offstop.cpp against the running torch's headers (cached); returns the .so path."""
    key, args = _plan()
    return cbuild.build_cached(NAME, key, args, "profiler stopper")


def _load() -> Any:
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        try:
            lib = ctypes.CDLL(build())  # CDLL: every call releases the GIL
            lib.aiprof_detach.restype = ctypes.c_void_p
            lib.aiprof_detach.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
            lib.aiprof_finish.restype = ctypes.c_int
            lib.aiprof_finish.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_size_t]
            _lib = lib
        except cbuild.BuildError as exc:
            _error = str(exc)
        except Exception as exc:  # dlopen (undefined symbol: another torch build), ImportError...
            _error = f"loading the profiler stopper: {type(exc).__name__}: {str(exc)[:200]}"
        return _lib


def prepare() -> None:
    """Load the helper now if it is built (milliseconds), else build and load it on a background
    thread; never raises (a failure is kept for :func:`unavailable`)."""
    global _building, _error
    with _lock:
        if _lib is not None or _error is not None or (_building is not None and _building.is_alive()):
            return
        try:
            cached = os.path.exists(cbuild.cached_path(NAME, _plan()[0]))
        except Exception as exc:  # no headers, no cache folder: the old stop it is
            _error = str(exc) if isinstance(exc, cbuild.BuildError) else f"{type(exc).__name__}: {exc}"
            return
        if not cached:
            _building = threading.Thread(target=_load, name="aiprof-offstop-build", daemon=True)
            _building.start()
            return
    _load()


def wait(timeout: float) -> Any:
    """Wait up to ``timeout`` s for a build :func:`prepare` started; the helper or None."""
    t = _building
    if t is not None:
        t.join(timeout)
    return _lib


def ready() -> Any:
    """The loaded helper, or None while it is building or where it is unavailable."""
    return _lib


def unavailable() -> str | None:
    """Why the helper cannot be used in this process (None: ready or still building)."""
    return _error


def detach(lib: Any) -> int:
    """On the thread that started the profiler: stop its recording there; returns the handle
    for :func:`finish`. Raises :class:`OffstopError` (nothing changed then)."""
    err = ctypes.create_string_buffer(ERR_BYTES)
    handle = lib.aiprof_detach(err, ERR_BYTES)
    if not handle:
        raise OffstopError(err.value.decode(errors="replace") or "detach failed")
    return int(handle)


def finish(lib: Any, handle: int, path: str, cupti_first: bool = False) -> None:
    """On any other thread: Kineto's post-processing, then the Chrome trace written to ``path``
    (GIL released throughout). ``cupti_first``: stop CUPTI's recording of new CUDA work before
    the post-processing (call it only once the GPU has finished the captured work). The handle
    is consumed. Raises :class:`OffstopError`."""
    err = ctypes.create_string_buffer(ERR_BYTES)
    if lib.aiprof_finish(ctypes.c_void_p(handle), path.encode(), int(cupti_first), err, ERR_BYTES) != 0:
        raise OffstopError(err.value.decode(errors="replace") or "finish failed")


def mark_stopped(prof: Any) -> None:
    """Tell torch's Python side the profiler is off, as ``profile.__exit__`` would have."""
    from torch.autograd import profiler as autograd_profiler

    inner = getattr(prof, "profiler", None)
    if inner is not None:
        inner.enabled = False  # a later __exit__ on it is a no-op
    autograd_profiler._run_on_profiler_stop()
