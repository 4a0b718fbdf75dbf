"""Detach CUPTI when a capture stops, so that the job's CUDA calls run as fast as before it.

Kineto keeps CUPTI attached after torch.profiler stops unless ``TEARDOWN_CUPTI=1`` (libkineto
reads it with getenv at every stop): CUPTI's callbacks stay subscribed and every CUDA call the
job makes pays for them, for the rest of the process. Measured on an H200 (GPT-2 124M, bf16,
fused AdamW; plain torch.profiler recording 5 steps; median step after the capture over the
median before): 1.080 with the variable unset, 1.107 with 0, **1.014 with 1**, against 1.011
for the same job with no capture at all. Through the agent (no teardown yet) the steps after a
capture ran 1.17-1.29x slower on the H200 and 1.3x on an H100.

Teardown is not safe everywhere: PyTorch's inductor turns it off when it compiles with CUDA
graphs (re-initialising CUPTI after a teardown crashed graph replays on CUDA 11 and 12). So the
agent sets it only where it sees no CUDA graphs, and the job's own setting always wins.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

ENV = "TEARDOWN_CUPTI"
# engines that replay CUDA graphs by default
GRAPH_ENGINES = ("vllm", "sglang", "tensorrt_llm")

_state: dict[str, Any] = {"ours": False, "graphs": False, "hooked": False}


def watch_graphs() -> None:
    """Note any CUDA graph the job captures from now on (a wrapper on ``CUDAGraph.capture_begin``,
    called once per graph capture, never per replay). Idempotent; never raises."""
    if _state["hooked"]:
        return
    try:
        graphs = sys.modules.get("torch.cuda.graphs")
        cls = getattr(graphs, "CUDAGraph", None) if graphs is not None else None
        if cls is None:
            return
        orig = cls.capture_begin

        def capture_begin(self: Any, *a: Any, **kw: Any) -> Any:
            _state["graphs"] = True
            return orig(self, *a, **kw)

        cls.capture_begin = capture_begin
        _state["hooked"] = True
    except Exception:  # a torch without it: the other signs below still count
        pass


def graphs_in_use() -> str | None:
    """Why the job counts as using CUDA graphs (None when no sign of them)."""
    if _state["graphs"]:
        return "the job captured a CUDA graph"
    for mod in GRAPH_ENGINES:
        if mod in sys.modules:
            return f"{mod} is loaded (it replays CUDA graphs)"
    cfg = sys.modules.get("torch._inductor.config")
    try:
        if cfg is not None and getattr(cfg.triton, "cudagraphs", False):
            return "torch.compile uses CUDA graphs (inductor's triton.cudagraphs)"
    except Exception:
        pass
    return None


def decide() -> dict[str, Any]:
    """Before ``stop_trace``: set ``TEARDOWN_CUPTI=1`` unless the job set it or uses CUDA graphs.
    Returns what was decided and why, for meta.json. Never raises."""
    try:
        have = os.environ.get(ENV)
        if have is not None and not _state["ours"]:
            return {"teardown": have == "1", "why": f"{ENV}={have} set by the job"}
        why = graphs_in_use()
        if why:
            if _state["ours"]:  # set by an earlier capture, before the graphs: take it back
                os.environ.pop(ENV, None)
                _state["ours"] = False
            return {"teardown": False, "why": f"{why}: CUPTI stays attached, CUDA calls may stay slower after "
                                              "the capture"}
        os.environ[ENV] = "1"
        _state["ours"] = True
        return {"teardown": True, "why": "no CUDA graphs seen: CUPTI detached at stop"}
    except Exception as exc:
        return {"teardown": None, "why": f"not decided: {type(exc).__name__}: {exc}"}


# Kineto tears CUPTI down on a thread it detaches (CuptiActivityApi::teardownContext): that thread
# subscribes to the runtime and driver API callbacks and waits until the exit callback of the
# process's next CUDA call runs cuptiFinalize. A job that makes no CUDA call after the capture
# stops (it ends right after it) never finalizes, and the process then hangs in exit: seen on
# 4 H100s with the off-thread stop, 7 of 8 jobs that ended 6 steps after their capture
# (bench/diagnosis/exit_hang.sh, 2026-11-26), none when the job went on or stopped on its own
# thread. So the thread that finished the profiler makes those calls itself until Kineto's thread
# is gone, for at most this long (off the training thread: the job never waits for it) ...
FINALIZE_WAIT_S = 3.0
# ... one cheap runtime call (cudaMemGetInfo) every this often.
FINALIZE_POLL_S = 0.01
_TASKS = "/proc/self/task"


# The name the thread that finishes the profiler gives itself (Linux: at most 15 bytes). A thread
# inherits its creator's name, so Kineto's teardown thread carries it too: the wait below is for
# the threads that carry it, not for the job's threads that happen to start meanwhile.
FINISHER_NAME = "aiprof-finish"
_PR_SET_NAME = 15


def _threads() -> frozenset[int] | None:
    """This process's native thread ids (Kineto's teardown thread is one), None where /proc is not."""
    try:
        return frozenset(int(t) for t in os.listdir(_TASKS))
    except (OSError, ValueError):
        return None


def _name(tid: int) -> str | None:
    try:
        with open(f"{_TASKS}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _name_this_thread() -> bool:
    """Give the calling thread FINISHER_NAME (prctl); False where it cannot (not Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_NAME, FINISHER_NAME.encode(), 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - no prctl: the wait falls back to every new thread
        return False


def threads_now() -> frozenset[int] | None:
    """Before the profiler is finished on this thread: name the thread (its children, Kineto's
    teardown thread among them, inherit the name) and note the threads there are."""
    _name_this_thread()
    return _threads()


def _runtime_call(cuda_device: int) -> None:
    import torch

    torch.cuda.mem_get_info(cuda_device)  # a runtime call: its exit callback finalizes CUPTI


def finalize(cuda_device: int, threads_before: frozenset[int] | None) -> dict[str, Any]:
    """After the profiler was finished on this thread with ``TEARDOWN_CUPTI=1``: make CUDA calls
    until the threads the finish started (Kineto's teardown thread among them: named FINISHER_NAME
    after this thread; else those new since ``threads_before``) have exited, for at most
    FINALIZE_WAIT_S. Threads by id and name, not a count: a job thread that exits or starts
    meanwhile must not pass for Kineto's. Returns ``{"done", "ms", "calls", "threads"}`` for meta.json. Never raises."""
    import time

    t0 = time.perf_counter()
    calls = 0
    done = False
    now = _threads()
    # the finish's threads carry this thread's name, the job's do not; by name, not by "new since
    # threads_before" alone: a thread id can be reused (seen in CI: Kineto's stand-in got the id of
    # a thread that had ended). Where none carries it, every new thread is waited for (bounded).
    me = threading.get_native_id()
    named = frozenset(t for t in now if t != me and _name(t) == FINISHER_NAME) if now is not None else frozenset()
    started = named or ((now - threads_before) if now is not None and threads_before is not None else None)
    try:
        while True:
            _runtime_call(cuda_device)
            calls += 1
            now = _threads()
            if started is not None and now is not None and not (started & now):
                done = True
                break
            if time.perf_counter() - t0 >= FINALIZE_WAIT_S:
                break
            time.sleep(FINALIZE_POLL_S)
    except Exception:  # noqa: S110 - a failing runtime call ends the wait; the export goes on
        pass
    return {"done": done, "ms": round((time.perf_counter() - t0) * 1e3, 3), "calls": calls,
            "threads": None if started is None else len(started)}


def pending() -> bool:
    """Whether Kineto tears CUPTI down at this stop (the agent or the job set the variable: the
    job's own TEARDOWN_CUPTI=1 leaves the same thread waiting for a CUDA call)."""
    return os.environ.get(ENV) == "1"
