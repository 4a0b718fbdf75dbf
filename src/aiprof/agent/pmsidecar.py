"""CUPTI PM sampling in a process of its own: one sampler process per capture and GPU.

Why a process. In the job's own process, CUPTI allows one PM session: Kineto finalises CUPTI at
a capture's stop, and CUPTI then refuses PM sampling for the rest of the process
(``cuptiPmSamplingGetCounterAvailability``: CUPTI_ERROR_UNKNOWN, every rank of 4-rank jobs,
bench/pm_repeat.sh). PM sampling reads the GPU's performance monitors, which count the work of
every process on the GPU; a process that only initialises the driver (``cuInit``: no CUDA
context, no GPU memory) samples the job's kernels as well as its own would (H100,
bench/pm_sidecar.sh: SM active 94.4 % during the job's matmuls and 0.0 % in its sleeps, from a
sampler with 0 MiB on the GPU). So each capture starts a fresh sampler process (``python -m
aiprof.agent.pmsidecar``) with a CUPTI of its own: every capture gets counters, and a fault
inside CUPTI ends the sampler, never the job.

The protocol is one JSON object per line over the child's stdin and stdout:

    child  -> {"ready": {timing_ms}}                          driver up; no CUPTI call yet
    parent -> {"cmd": "start"}   child -> {"started": {chip, columns, metrics, timing_ms}}
    parent -> {"cmd": "stop"}    child -> {"stopped": {stats}}  rows in <dir>/pm.npz; it exits
    child  -> {"error": "one line"}                            then it exits 1

The child's CUPTI never overlaps the job's: the agent sends "start" once the job's profiler is
prepared, and waits for the child's exit before the profiler stops (a PM set-up that overlapped
the job's CUPTI set-up crashed 3 of 7 4-rank jobs on H100s, in the job, not the sampler).

The child stops sampling and exits when its stdin closes (the job is gone) or after
``MAX_LIFETIME_S``; the parent bounds every wait and kills a child that does not answer.
``--prewarm`` only resolves the metrics (cached per chip on disk) and exits: what the agent does
while armed, so that a capture's sampler only configures.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, ClassVar

#: Longest a child may live: the longest capture (pmsampling.MAX_ROWS is 60 s at 100 µs) plus
#: the waits for its profiler and its set-up, with room to spare.
MAX_LIFETIME_S = 600.0
#: Longest the parent waits for a child to be ready: the first use in a host compiles the C side
#: and resolves the metrics (3.1 s on an H100 with neither cached, bench/pm_sidecar.sh; up to
#: 11.5 s in a 4-rank job's process); a child that takes longer is killed.
READY_TIMEOUT_S = 60.0
#: Longest the parent waits for "started": CUPTI's set-up and the PM configuration (0.7-2.6 s
#: with 4 ranks at once on 4 H100s, bench/pm_repeat.sh).
START_TIMEOUT_S = 30.0
#: Longest the parent waits for "stopped" (the C side's stop is bounded by
#: pmsampling.STOP_TIMEOUT_S, writing 600k rows by about a second more).
ANSWER_TIMEOUT_S = 15.0
#: Longest a killed child is waited for.
KILL_WAIT_S = 5.0
ROWS_FILE = "pm.npz"
#: The child's stderr kept for a failure's message (its last line).
STDERR_TAIL_BYTES = 4096


class SidecarError(RuntimeError):
    """The sampler process could not sample; ``str()`` is the one-line reason for meta.json.
    ``reported``: the child said it itself (its ``error`` answer), not a crash, a silence or a
    stray line read from its stderr."""

    def __init__(self, msg: str, reported: bool = False) -> None:
        super().__init__(msg)
        self.reported = reported


# ---------------------------------------------------------------------------------------- child
def _send(out: IO[str], obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _wait_line(fd: int, buf: bytearray, deadline: float) -> str | None:
    """The next line from ``fd`` before ``deadline`` (None: closed or timed out)."""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        buf.extend(chunk)
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode(errors="replace")


def init_driver() -> None:
    """Initialise the CUDA driver without a context: CUPTI's profiler needs the driver, and a
    context would cost GPU memory (~600 MiB on an H100) for nothing."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise SidecarError(f"no CUDA driver ({exc})") from exc
    rc = cuda.cuInit(0)
    if rc != 0:
        raise SidecarError(f"cuInit failed (CUresult {rc})")


def serve(args: argparse.Namespace, inp: int, out: IO[str], sampler_cls: Any = None) -> int:
    """The child's life: the driver up, then (told to start) CUPTI, configure and sample; told to
    stop, the rows to ``args.out_dir``. ``sampler_cls`` stands for pmsampling.PmSampler (tests on
    machines without a GPU)."""
    deadline = time.monotonic() + MAX_LIFETIME_S
    buf = bytearray()
    try:
        t0 = time.perf_counter()
        metrics = json.loads(args.metrics) if args.metrics else None
        parts: dict[str, float] = {}
        if sampler_cls is None:
            from aiprof.agent import pmsampling

            parts["import"] = round((time.perf_counter() - t0) * 1e3, 1)
            t1 = time.perf_counter()
            init_driver()
            parts["driver"] = round((time.perf_counter() - t1) * 1e3, 1)
            if args.libcupti:
                os.environ[pmsampling.LIBCUPTI_ENV] = args.libcupti
            if args.prewarm:  # while the job's agent is armed: no profiler of the job's runs now
                metrics = pmsampling.prewarm(args.device)
                _send(out, {"ready": {"metrics": metrics, "columns": list(metrics),
                                      "timing_ms": {**parts, "prewarm": round((time.perf_counter() - t1) * 1e3, 1)}}})
                return 0
            sampler_cls = pmsampling.PmSampler
        # No CUPTI call before "start": the parent sends it once the job's profiler is prepared,
        # and our PM set-up overlapping the job's CUPTI set-up crashed 3 of 7 4-rank jobs (H100s)
        _send(out, {"ready": {"timing_ms": parts}})
        line = _wait_line(inp, buf, deadline)
        if line is None or json.loads(line).get("cmd") != "start":
            return 0  # the capture ended before it started (or the job is gone): nothing to write
        pm = sampler_cls(args.device, args.interval_us, metrics=metrics)
        pm.start()
        _send(out, {"started": {"chip": pm.chip, "columns": pm.columns, "metrics": pm.metrics,
                                "timing_ms": {**parts, **pm.timing_ms}}})
        line = _wait_line(inp, buf, deadline)  # "stop", or the job is gone, or our lifetime is over
        got = pm.stop()
        if line is None and time.monotonic() < deadline:  # the job is gone: nobody takes the rows
            shutil.rmtree(args.out_dir, ignore_errors=True)
            return 0
        import numpy as np

        tmp = os.path.join(args.out_dir, ROWS_FILE + ".tmp.npz")
        np.savez(tmp, t0=got.t0, t1=got.t1, values=got.values,
                 batches=np.array([[b["row_end"], b["cupti_ns"], b["unix_ns"]] for b in got.batches],
                                  dtype=np.int64).reshape(-1, 3))
        os.replace(tmp, os.path.join(args.out_dir, ROWS_FILE))
        _send(out, {"stopped": {"clock": got.clock, "stats": got.stats, "columns": got.columns,
                                "metrics": got.metrics, "rows": int(len(got.t0)),
                                "cpu_s": round(time.process_time(), 3)}})  # every thread's, start-up included
        return 0
    except Exception as exc:  # every failure is one line for the parent
        msg = str(exc) if type(exc).__name__ in ("PmUnavailable", "SidecarError") else f"{type(exc).__name__}: {exc}"
        try:
            _send(out, {"error": " ".join(msg.split())})
        except OSError:
            pass
        return 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m aiprof.agent.pmsidecar", description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0, help="CUDA device index (0 under CUDA_VISIBLE_DEVICES=<uuid>)")
    ap.add_argument("--interval-us", type=int, default=100)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--libcupti", default="", help="the libcupti to open (the job's)")
    ap.add_argument("--metrics", default="", help="column -> CUPTI metric as JSON (resolved by a prewarm)")
    ap.add_argument("--prewarm", action="store_true", help="resolve the metrics (cached per chip) and exit")
    return ap.parse_args(argv)


def protocol_stdout() -> IO[str]:
    """The protocol's own copy of stdout; fd 1 itself then goes to stderr, so that whatever a
    library prints (CUPTI, the driver) cannot come between the protocol's lines."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv), sys.stdin.fileno(), protocol_stdout())


# --------------------------------------------------------------------------------------- parent
def child_env(device_uuid: str | None) -> dict[str, str]:
    """The child's environment: the job's, with its GPU the only one visible (so device 0 is the
    job's, whatever the job's own CUDA_VISIBLE_DEVICES), and this aiprof importable."""
    env = dict(os.environ)
    if device_uuid:
        env["CUDA_VISIBLE_DEVICES"] = device_uuid
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


class PmSidecar:
    """The parent's handle on one sampler process: started at construction, then
    :meth:`wait_ready`, :meth:`start` and :meth:`stop`. Every method raises
    :class:`SidecarError` with one line."""

    #: The child's command before its arguments; None: this module under the job's Python.
    #: (Tests on machines without a GPU name a script whose sampler stands in for CUPTI's.)
    command: ClassVar[list[str] | None] = None

    def __init__(self, device_uuid: str | None, device: int, interval_us: int, prewarm: bool = False,
                 metrics: dict[str, str] | None = None) -> None:
        """Start the child (returns at once; :meth:`wait_ready` waits for its set-up). ``metrics``
        (what a prewarm resolved) spares the child resolving them: a second or more of CUPTI
        configuration images with four ranks setting up at once."""
        self.device = 0 if device_uuid else device
        self.dir = tempfile.mkdtemp(prefix="aiprof-pm-")
        self._buf = bytearray()
        self._err = tempfile.TemporaryFile()
        self.chip = ""
        self.columns: list[str] = []
        self.metrics: dict[str, str] = {}
        self.timing_ms: dict[str, float] = {}
        cmd = list(self.command or [sys.executable, "-m", "aiprof.agent.pmsidecar"])
        cmd += ["--device", str(self.device), "--interval-us", str(interval_us), "--out-dir", self.dir]
        lib = _job_libcupti()
        if lib:
            cmd += ["--libcupti", lib]
        if prewarm:
            cmd.append("--prewarm")
        if metrics:
            cmd += ["--metrics", json.dumps(metrics)]
        self._t0 = time.perf_counter()
        try:
            # a session of its own: the job's process-group signals (a Ctrl-C) do not reach it; it
            # ends when its stdin closes, which the job's exit does
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                         env=child_env(device_uuid), close_fds=True, start_new_session=True)
        except OSError as exc:
            self.close()
            raise SidecarError(f"the PM sampler process did not start: {exc}") from exc

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait (bounded) until the child has the driver up (a prewarm: its metrics resolved)."""
        ready = self._answer("ready", timeout)
        self.columns = list(ready.get("columns") or [])
        self.metrics = dict(ready.get("metrics") or {})
        self.timing_ms = {"process": round((time.perf_counter() - self._t0) * 1e3, 1), **(ready.get("timing_ms") or {})}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _tell(self, cmd: str, answered: bool = False) -> None:
        """Send ``cmd``. ``answered``: the child may have answered already and exited (it stops
        by itself at MAX_LIFETIME_S and writes its rows): a closed pipe is then not a failure."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"cmd": cmd}) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            if not answered:
                raise self._failed(f"could not be told to {cmd} ({exc})") from exc

    def _answer(self, key: str, timeout: float) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = _wait_line(self.proc.stdout.fileno(), self._buf, deadline)
        if line is None:
            ended = time.monotonic() < deadline  # its stdout closed before the time was up
            if ended:
                try:
                    self.proc.wait(KILL_WAIT_S)  # for how it ended
                except subprocess.TimeoutExpired:
                    pass
            raise self._failed(f"ended before '{key}'" if ended else f"gave no '{key}' within {timeout:.0f} s")
        try:
            msg = json.loads(line)
        except ValueError:
            raise self._failed(f"answered {line[:120]!r}") from None
        if "error" in msg:
            self.close()
            raise SidecarError(str(msg["error"]), reported=True)
        if key not in msg:
            raise self._failed(f"answered {sorted(msg)} instead of '{key}'")
        got = msg[key]
        return got if isinstance(got, dict) else {}

    def _failed(self, what: str) -> SidecarError:
        """Kill the child; the error says what it did and how it ended (signal, last stderr line)."""
        rc = self.proc.poll()
        if rc is None:
            self.kill()
            rc = self.proc.poll()
        how = (f"killed by signal {-rc}" if rc is not None and rc < 0 else
               f"exit {rc}" if rc is not None else "still running")
        tail = ""
        try:
            self._err.seek(0, os.SEEK_END)
            size = self._err.tell()
            self._err.seek(max(0, size - STDERR_TAIL_BYTES))
            lines = [ln for ln in self._err.read().decode(errors="replace").splitlines() if ln.strip()]
            tail = f": {lines[-1].strip()[:200]}" if lines else ""
        except (OSError, ValueError):
            pass
        self.close()
        return SidecarError(f"the PM sampler process {what} ({how}){tail}")

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Set CUPTI up in the child, configure and start sampling (bounded)."""
        t0 = time.perf_counter()
        self._tell("start")
        got = self._answer("started", timeout)
        self.chip = str(got.get("chip", ""))
        self.columns = list(got.get("columns") or [])
        self.metrics = dict(got.get("metrics") or {})
        self.timing_ms.update(got.get("timing_ms") or {})
        self.timing_ms["start"] = round((time.perf_counter() - t0) * 1e3, 1)

    def stop(self, timeout: float = ANSWER_TIMEOUT_S) -> Any:
        """Stop sampling; returns the rows as pmsampling.PmSamples (the child then exits)."""
        import numpy as np

        from aiprof.agent.pmsampling import PmSamples

        self._tell("stop", answered=True)
        got = self._answer("stopped", timeout)
        try:
            with np.load(os.path.join(self.dir, ROWS_FILE)) as z:
                t0, t1, values, batches = z["t0"], z["t1"], z["values"], z["batches"]
        except (OSError, KeyError, ValueError) as exc:
            raise self._failed(f"left no readable rows ({exc})") from exc
        stats = dict(got.get("stats") or {})
        stats["sampler_process"] = {"pid": self.proc.pid, "cpu_s": got.get("cpu_s")}
        self.close()  # waits for its exit: its CUPTI is gone before the job's profiler stops
        return PmSamples(self.device, list(got.get("columns") or self.columns), list(got.get("metrics") or []),
                         t0, t1, values, list(got.get("clock") or []),
                         [{"row_end": int(a), "cupti_ns": int(b), "unix_ns": int(c)} for a, b, c in batches.tolist()],
                         stats)

    def kill(self) -> None:
        """End the child at once (safe at any point: its CUPTI is its own)."""
        try:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(KILL_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def close(self) -> None:
        """Close the pipes (a child still waiting sees its stdin close and exits), reap it, and
        remove its folder. Idempotent, never raises."""
        proc = getattr(self, "proc", None)
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
            try:
                proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        try:
            self._err.close()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _job_libcupti() -> str | None:
    """The libcupti this (the job's) process has loaded, so the child opens the same one."""
    try:
        from aiprof.agent.pmsampling import loaded_libcupti

        return loaded_libcupti()
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
