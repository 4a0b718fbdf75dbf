"""Worker processes for parallel ingest, started by aiprof itself (never by multiprocessing).

multiprocessing's ``spawn`` and ``forkserver`` start methods re-import the caller's ``__main__``
in every worker: a script without an ``if __name__ == "__main__":`` guard runs again in each
worker (and starts a pool of its own), and ``python - < script.py`` cannot be re-imported at
all. ``fork`` copies a process whose other threads may hold locks. These workers are plain
``python -I -c`` processes that import only this module (with the caller's ``sys.path``), speak
length-prefixed frames on their stdin/stdout pipes and exit when their stdin closes, so they
never outlive the caller. When they cannot be started or answer wrongly, ingest falls back to
one process (:class:`WorkerLost`).
"""
from __future__ import annotations

import json
import os
import pickle
import queue
import selectors
import signal
import struct
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["WorkerLost", "WorkerPool", "serve", "usable_cpus"]

# A fresh interpreter imports numpy, pyarrow and msgspec; on a loaded 2-core machine that takes
# seconds. A worker silent for longer is not a Python that runs this module (embedded, frozen).
START_TIMEOUT_S = 60.0
_HELLO = b"aiprof-ingest-worker/1"
_LEN = struct.Struct("<Q")
_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from aiprof.trace.workers import serve; serve()")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class WorkerLost(Exception):
    """A worker could not be started, died, or answered something that is not a frame."""


def _read_exact(f, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise EOFError
        got += k
    return buf


def _read_frame(f) -> bytearray:
    (n,) = _LEN.unpack(_read_exact(f, _LEN.size))
    return _read_exact(f, n)


def _write_frame(f, *parts) -> None:
    f.write(_LEN.pack(sum(len(p) for p in parts)))
    for p in parts:
        f.write(p)
    f.flush()


class _Worker:
    """One worker process and the pipes to it; used by one thread at a time."""

    def __init__(self) -> None:
        exe = sys.executable
        if not exe or getattr(sys, "frozen", False):
            raise WorkerLost("no Python interpreter to start workers with")
        try:
            self.proc = subprocess.Popen(
                [exe, "-I", "-c", _BOOT, json.dumps([p for p in sys.path if isinstance(p, str)])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=False, close_fds=True)
        except (OSError, ValueError) as exc:
            raise WorkerLost(f"cannot start a worker ({exc})") from None
        self.ready = False

    def _hello(self) -> None:
        """Wait for the worker's greeting: proof that it is a Python running this module."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not sel.select(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    raise WorkerLost("a worker did not start in time")
        finally:
            sel.close()
        try:
            if bytes(_read_frame(self.proc.stdout)) != _HELLO:
                raise WorkerLost("a worker answered something else than its greeting")
        except (EOFError, OSError, struct.error):
            raise WorkerLost("a worker exited while starting") from None
        self.ready = True

    def run(self, block: memoryview) -> object:
        """Send one block of events (without brackets); return what the worker made of it."""
        if not self.ready:
            self._hello()
        try:
            _write_frame(self.proc.stdin, b"[", block, b"]")
            return pickle.loads(_read_frame(self.proc.stdout))
        except (EOFError, OSError, ValueError, pickle.UnpicklingError, struct.error):
            raise WorkerLost("a worker died while decoding") from None

    def stop(self, kill: bool) -> None:
        p = self.proc
        try:
            if kill:
                p.kill()
            else:
                p.stdin.close()  # the worker exits when its input ends
        except OSError:
            pass
        try:
            p.wait(timeout=None if kill else 10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except OSError:
                pass


class WorkerPool:
    """``n`` worker processes; :meth:`submit` returns a future of one block's result.

    Results are whatever the worker function returns (see :func:`serve`). Use as a context
    manager: leaving it stops the workers, killing them when leaving on an exception.
    """

    def __init__(self, n: int) -> None:
        self.workers: list[_Worker] = []
        try:
            for _ in range(n):
                self.workers.append(_Worker())
        except WorkerLost:
            self.close(kill=True)
            raise
        self.idle: queue.Queue[_Worker] = queue.Queue()
        for w in self.workers:
            self.idle.put(w)
        self.threads = ThreadPoolExecutor(max_workers=n, thread_name_prefix="aiprof-ingest")

    def _run(self, block: memoryview) -> object:
        w = self.idle.get()
        try:
            return w.run(block)
        finally:
            self.idle.put(w)

    def submit(self, block: memoryview) -> Future:
        return self.threads.submit(self._run, block)

    def close(self, kill: bool = False) -> None:
        for w in self.workers:  # first: a thread blocked on a killed worker's pipe gets EOF
            w.stop(kill)
        if hasattr(self, "threads"):
            self.threads.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> WorkerPool:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(kill=exc_type is not None)


def serve() -> None:
    """Worker main loop: decode each block it is sent, answer with the pickled result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle; it stops us
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not corrupt the frames on stdout
    inp = os.fdopen(0, "rb", buffering=0)
    from aiprof.trace.kineto import decode_block

    _write_frame(out, _HELLO)
    while True:
        try:
            block = _read_frame(inp)
        except EOFError:
            return
        result: object | None
        try:
            result = decode_block(block)
        except Exception:  # noqa: BLE001 - the caller re-reads the file in one process and reports
            result = None
        _write_frame(out, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
