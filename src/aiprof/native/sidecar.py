"""The native sidecar: a separate process that traces the job's library calls, system calls and
native stacks, so that nothing but Frida's small in-process hooks runs inside the job.

Started by the in-process agent (:mod:`aiprof.agent.native`) as
``python -m aiprof.native.sidecar`` with one JSON line of configuration on stdin; then it
talks JSON lines both ways:

* sidecar -> agent: ``{"event": "ready", ...}`` once hooks are in (or why there are none);
  ``{"event": "finished", ...}`` after each ``finish``.
* agent -> sidecar: ``{"cmd": "start"}`` when a capture starts recording (syscall sampling and
  py-spy begin; probe records are kept from now on); ``{"cmd": "finish", "dir": D,
  "window_unix_ns": [a, b], "trace_minus_unix_us": x}`` when it stopped: the sidecar writes
  ``calls.csv``, ``syscalls.csv`` and ``native.folded`` into D on the trace clock.

stdin closing (the job exited, or the agent let go) ends the sidecar: hooks are removed and
Frida detaches, so the job runs on untouched.
"""
from __future__ import annotations

import csv
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

DRAIN_INTERVAL_S = 0.05  # the ring holds 65k calls: drained 20x/s it never laps below 1.3M calls/s
RESCAN_INTERVAL_S = 1.0  # with Frida's module observer (17+): a library loaded later is hooked within 1 s
RESCAN_POLL_INTERVAL_S = 5.0  # without it (Frida 16) each scan enumerates every module in the job
MAX_CALLS_PER_S = 20_000  # at ~0.5 µs a call this costs ~1% of a thread: a symbol hotter is unhooked
RATE_WINDOW_S = 1.0  # the rate above is measured over this window
MAX_KEPT_RECORDS = 1_000_000  # 104 MB: a capture window keeps at most this many calls
BACKLOG_RECORDS = 100_000  # kept before "start" arrives: calls between the agent's start and ours
PYSPY_STOP_TIMEOUT_S = 15.0  # py-spy writes its samples on SIGINT; bounded wait for it
PYSPY_DEFAULT_RATE = 100  # Hz: each --native sample pauses the job's threads to unwind them
PYSPY_READY_TIMEOUT_S = 20.0  # py-spy --native reads the unwind tables of every library before its
# first sample (seconds on a loaded host); below the agent's 30 s for the whole set-up, Frida's included
TRACE_POLL_S = 0.001  # a --native sample stops the job for milliseconds: polled finer than that


def _send(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


class Sidecar:
    """State of one sidecar: the probe engine, the syscall sampler and py-spy."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.pid = int(cfg["pid"])
        self.engine: Any = None
        self.spec: Any = None
        self.notes: list[str] = []
        self.recording = False
        self.kept: list[np.ndarray] = []
        self.kept_n = 0
        self.truncated = 0
        self.unhooked: dict[str, str] = {}
        self.rate_t0 = time.monotonic()
        self.rate_counts: dict[int, int] = {}
        self.sampler: Any = None
        self.pyspy: subprocess.Popen | None = None
        self.pyspy_out = ""
        self.pyspy_started_ns = 0
        self.pyspy_err = ""
        self.pyspy_first_sample_s: float | None = None  # how long after "Sampling process" it came
        self.next_scan = 0.0
        self.thread_names: dict[int, str] = {}

    # -- set-up -----------------------------------------------------------------------------
    def setup(self) -> dict[str, Any]:
        ready: dict[str, Any] = {"event": "ready", "pid": os.getpid()}
        if self.cfg.get("probes"):
            from aiprof.native.engine import EngineError, ProbeEngine, frida_status
            from aiprof.native.probes import ProbeSpec

            self.spec = ProbeSpec.from_dict(self.cfg["probes"])
            ok, ver = frida_status()
            ready["frida"] = ver if ok else None
            if not ok:
                self.notes.append(f"library calls not traced: {ver}")
            else:
                try:
                    t0 = time.perf_counter()
                    self.engine = ProbeEngine(self.pid, self.spec)
                    self.engine.start()
                    ready["attach_s"] = round(time.perf_counter() - t0, 3)
                    ready["hooked_unix_ns"] = time.time_ns()
                    ready["hooked"] = sorted(self.engine.hooked)
                    ready["missing"] = sorted(self.engine.missing)
                except EngineError as exc:
                    self.engine = None
                    self.notes.append(f"library calls not traced: {exc}")
            self.next_scan = time.monotonic() + RESCAN_INTERVAL_S
        if self.cfg.get("native_stacks"):
            # py-spy --native needs seconds to load symbols: it starts now, so that it samples
            # when the capture starts (its samples then cover the armed iterations too)
            self._start_pyspy()
            ready["native_stacks"] = self.pyspy is not None
            ready["native_first_sample_s"] = self.pyspy_first_sample_s
        ready["notes"] = list(self.notes)
        return ready

    # -- steady state -----------------------------------------------------------------------
    def tick(self) -> None:
        """Drain the ring, enforce the rate limit, hook newly loaded modules."""
        eng = self.engine
        if eng is None:
            return
        if not eng.alive:
            self.notes.append("the traced process went away or Frida detached")
            self.engine = None
            return
        recs = eng.drain()
        if len(recs):
            syms, counts = np.unique(recs["sym"], return_counts=True)
            for s, c in zip(syms.tolist(), counts.tolist()):
                self.rate_counts[s] = self.rate_counts.get(s, 0) + c
            if not self.recording:  # a short backlog: "start" names a time that may have passed
                self.kept.append(recs)
                self.kept_n += len(recs)
                while self.kept_n - len(self.kept[0]) >= BACKLOG_RECORDS:
                    self.kept_n -= len(self.kept.pop(0))
            else:
                room = MAX_KEPT_RECORDS - self.kept_n
                if room < len(recs):
                    self.truncated += len(recs) - max(room, 0)
                    recs = recs[:max(room, 0)]
                if len(recs):
                    self.kept.append(recs)
                    self.kept_n += len(recs)
        now = time.monotonic()
        if now - self.rate_t0 >= RATE_WINDOW_S:
            span = now - self.rate_t0
            by_id = {s["id"]: s for s in self.spec.symbols}
            for sid, c in self.rate_counts.items():
                rate = c / span
                s = by_id.get(sid)
                if s is None or rate <= MAX_CALLS_PER_S or s.get("allow_hot"):
                    continue
                key = f"{s['lib']}:{s['symbol']}"
                if key not in self.unhooked and eng.unhook(key):
                    self.unhooked[key] = f"{rate:,.0f} calls/s > {MAX_CALLS_PER_S:,}/s"
                    self.notes.append(f"{key} unhooked: {rate:,.0f} calls/s would slow the job "
                                      f"(limit {MAX_CALLS_PER_S:,}/s; \"allow_hot\": true keeps it)")
            self.rate_counts.clear()
            self.rate_t0 = now
        if now >= self.next_scan:
            try:
                eng.scan()
            except Exception as exc:
                self.notes.append(f"module scan: {type(exc).__name__}: {exc}")
            self.next_scan = now + (RESCAN_INTERVAL_S if eng.observed else RESCAN_POLL_INTERVAL_S)

    def start(self, since_ns: int) -> None:
        """A capture starts recording at ``since_ns`` (unix): keep probe records from then on,
        sample syscalls, run py-spy."""
        self.tick()
        self.kept = [r[r["t0"] >= since_ns] for r in self.kept]  # the backlog from the capture's start on
        self.kept_n = sum(len(r) for r in self.kept)
        self.truncated = 0
        self.recording = True
        if self.cfg.get("syscalls"):
            from aiprof.native.syscalls import DEFAULT_INTERVAL_S, SyscallSampler

            self.sampler = SyscallSampler(self.pid, float(self.cfg.get("syscall_interval_s") or DEFAULT_INTERVAL_S))
            self.sampler.start()
        if self.cfg.get("native_stacks") and self.pyspy is None:
            self._start_pyspy()

    def _start_pyspy(self) -> None:
        import tempfile

        from aiprof.tools import find_py_spy

        try:
            exe = find_py_spy()
        except Exception as exc:
            self.notes.append(f"native stacks not sampled: {exc}")
            return
        fd, self.pyspy_out = tempfile.mkstemp(prefix="aiprof-native-", suffix=".folded")
        os.close(fd)
        rate = int(self.cfg.get("pyspy_rate") or PYSPY_DEFAULT_RATE)
        # --idle: a thread that waits (a training thread blocked in read(), a lock, a collective)
        # is where the job's time goes; without it py-spy drops those samples, and a job that
        # mostly waits had no stack of its training thread in the few samples a loaded host takes
        # (7 samples in 0.85 s, none of the main thread: a CI failure, 2 busy cores)
        cmd = [exe, "record", "--native", "--threads", "--idle", "--format", "raw", "--rate", str(rate),
               "--pid", str(self.pid), "--output", self.pyspy_out, "--nonblocking"]
        if self.cfg.get("pyspy_blocking", True):
            cmd.remove("--nonblocking")  # --native unwinding needs the threads paused
        try:
            self.pyspy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True)
        except OSError as exc:
            self.notes.append(f"native stacks not sampled: py-spy: {exc}")
            self.pyspy = None
            return
        # py-spy prints "Sampling process ..." before its first sample, which, with --native, loads
        # the unwind tables of every library first: on a loaded host that sample came 1-8 s after
        # the line (measured on 2 busy cores), so the capture started before any stack was taken
        # and the native flame held only the export thread. Wait for the line, then for the
        # first sample itself (blocking mode: py-spy's ptrace stops of the job).
        import threading

        seen = threading.Event()

        def watch(stream: Any) -> None:
            for line in stream:
                if "Sampling process" in line or "times a second" in line:
                    seen.set()
            seen.set()  # py-spy exited: no reason to wait longer

        threading.Thread(target=watch, args=(self.pyspy.stdout,), daemon=True).start()
        deadline = time.monotonic() + PYSPY_READY_TIMEOUT_S
        if not seen.wait(PYSPY_READY_TIMEOUT_S):
            self.notes.append(f"py-spy did not start sampling in {PYSPY_READY_TIMEOUT_S:.0f} s")
        elif "--nonblocking" not in cmd and self.pyspy.poll() is None:
            took = first_sample_taken(self.pid, self.pyspy.pid, deadline)
            self.pyspy_first_sample_s = None if took is None else round(took, 3)
            if took is None:
                self.notes.append(f"py-spy took no native sample within {PYSPY_READY_TIMEOUT_S:.0f} s: "
                                  "the first steps of the capture may have none")
        self.pyspy_started_ns = time.time_ns()

    def _stop_pyspy(self) -> str | None:
        p, self.pyspy = self.pyspy, None
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=PYSPY_STOP_TIMEOUT_S)
            err = p.stderr.read() if p.stderr else ""
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
            self.notes.append(f"py-spy did not stop in {PYSPY_STOP_TIMEOUT_S:.0f} s; native stacks dropped")
            return None
        try:
            if os.path.getsize(self.pyspy_out) > 0:
                return self.pyspy_out
        except OSError:
            pass
        lines = [ln for ln in (err or "").splitlines() if ln.strip()]
        self.notes.append("native stacks: py-spy wrote no samples" + (f" ({lines[-1].strip()})" if lines else ""))
        return None

    def finish(self, d: str, window: list[int], offset_us: float) -> dict[str, Any]:
        """Write this capture's files into ``d``; returns what was written (the reply)."""
        self.tick()
        self.recording = False
        out: dict[str, Any] = {"event": "finished", "files": {}, "notes": []}
        kept, self.kept, self.kept_n = self.kept, [], 0
        a, b = int(window[0]), int(window[1])
        os.makedirs(d, exist_ok=True)
        if self.spec is not None:
            recs = np.concatenate(kept) if kept else np.zeros(0)
            n = write_calls_csv(os.path.join(d, CALLS_FILE), recs, self.spec, a, b, offset_us,
                                self._thread_names(recs))
            out["calls"] = {"rows": n, "hooked": sorted(self.engine.hooked) if self.engine else [],
                            "missing": sorted(self.engine.missing) if self.engine else [],
                            "unhooked": self.unhooked, "truncated": self.truncated,
                            **(self.engine.stats() if self.engine else {})}
            if n:
                out["files"]["calls"] = CALLS_FILE
            else:  # no file rather than a header alone: meta.json says why (hooked, notes)
                os.unlink(os.path.join(d, CALLS_FILE))
        if self.sampler is not None:
            s, self.sampler = self.sampler, None
            eps = s.stop()
            n = write_syscalls_csv(os.path.join(d, SYSCALLS_FILE), eps, s.thread_names, s.interval_s, a, b, offset_us)
            out["syscalls"] = {"rows": n, "interval_ms": round(s.interval_s * 1e3, 3), "samples": s.samples,
                               "ticks": s.ticks, "threads": len(s.thread_names), "errors": s.errors,
                               "truncated": s.truncated}
            if n:
                out["files"]["syscalls"] = SYSCALLS_FILE
            else:
                os.unlink(os.path.join(d, SYSCALLS_FILE))
        folded = self._stop_pyspy()
        if folded:
            dst = os.path.join(d, NATIVE_FILE)
            try:
                import shutil

                shutil.move(folded, dst)
                out["files"]["native"] = NATIVE_FILE
                out["native_stacks"] = {"from_unix_ns": self.pyspy_started_ns, "to_unix_ns": time.time_ns(),
                                        "rate_hz": int(self.cfg.get("pyspy_rate") or PYSPY_DEFAULT_RATE)}
            except OSError as exc:
                self.notes.append(f"native stacks: {exc}")
        out["notes"] = list(self.notes)
        self.notes.clear()
        return out

    def _thread_names(self, recs: np.ndarray) -> dict[int, str]:
        names = {}
        for tid in (np.unique(recs["tid"]).tolist() if len(recs) else []):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/comm") as f:
                    names[tid] = f.read().strip()
            except OSError:
                names[tid] = ""
        return names

    def close(self) -> None:
        """Remove hooks, stop samplers; never raises."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.pyspy is not None:
            try:
                self.pyspy.kill()
            except OSError:
                pass
        if self.engine is not None:
            self.engine.close()


def _status_field(tid: int, field: str) -> int:
    """An integer field of /proc/TID/status (``TracerPid``, ``Tgid``); 0 when it cannot be read."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


SAMPLER_STOPS = 2  # py-spy stops the job once to set up (~25 ms), then once per sample


def first_sample_taken(pid: int, sampler_pid: int, deadline: float) -> float | None:
    """Wait until threads of ``sampler_pid`` (py-spy in blocking mode) have ptrace-stopped
    ``pid`` and let it go SAMPLER_STOPS times: its set-up and its first sample are done. A stop
    shorter than the poll may be missed; a later one counts. Returns the seconds waited, or None
    at ``deadline`` (time.monotonic) or when ``pid`` is gone."""
    t0 = time.monotonic()
    stopped, ended = False, 0
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return None
        tracer = _status_field(pid, "TracerPid")  # the thread that ptrace-stops the job now
        if tracer and (stopped or _status_field(tracer, "Tgid") == sampler_pid):
            stopped = True
        elif stopped:
            stopped, ended = False, ended + 1
            if ended >= SAMPLER_STOPS:
                return time.monotonic() - t0
        time.sleep(TRACE_POLL_S)
    return None


CALLS_FILE = "calls.csv"
SYSCALLS_FILE = "syscalls.csv"
NATIVE_FILE = "native.folded"
CALLS_COLUMNS = ["ts_us", "dur_us", "tid", "thread", "lib", "symbol", "ret", "args"]
SYSCALLS_COLUMNS = ["ts_us", "dur_us", "tid", "thread", "syscall", "class", "samples", "fd", "path"]


def write_calls_csv(path: str, recs: np.ndarray, spec: Any, a_ns: int, b_ns: int, offset_us: float,
                    thread_names: dict[int, str]) -> int:
    """calls.csv: the calls that started inside [a, b] (unix ns), times on the trace clock (µs).
    ``args`` is a JSON object of the probe file's named arguments."""
    from aiprof.native.probes import decode_args

    by_id = {s["id"]: s for s in spec.symbols}
    if len(recs):
        recs = recs[(recs["t0"] >= a_ns) & (recs["t0"] <= b_ns)]
        recs = recs[np.argsort(recs["t0"], kind="stable")]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CALLS_COLUMNS)
        for r in recs:
            s = by_id.get(int(r["sym"]))
            if s is None:
                continue
            t0, t1 = int(r["t0"]), int(r["t1"])
            args = decode_args(s, [int(x) for x in r["args"]])
            ret = int(r["ret"]) & 0xFFFFFFFF
            ret = ret - (1 << 32) if ret >> 31 else ret
            w.writerow([f"{t0 / 1000.0 + offset_us:.3f}", f"{max(t1 - t0, 0) / 1000.0:.3f}", int(r["tid"]),
                        thread_names.get(int(r["tid"]), ""), s["lib"], s["symbol"], ret,
                        json.dumps(args, separators=(",", ":"))])
    os.replace(tmp, path)
    return int(len(recs))


def write_syscalls_csv(path: str, episodes: list, names: dict[int, str], interval_s: float, a_ns: int, b_ns: int,
                       offset_us: float) -> int:
    """syscalls.csv: one row per episode that overlaps [a, b]; duration = samples × interval
    (the time the thread was seen blocked in the call), start = first sample."""
    from aiprof.native.syscalls import syscall_class, syscall_name

    n = 0
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SYSCALLS_COLUMNS)
        for e in episodes:
            if e.last_ns < a_ns or e.first_ns > b_ns:
                continue
            name = syscall_name(e.nr)
            w.writerow([f"{e.first_ns / 1000.0 + offset_us:.3f}", f"{e.samples * interval_s * 1e6:.1f}", e.tid,
                        names.get(e.tid, ""), name, syscall_class(name), e.samples,
                        e.args[0] if syscall_class(name) == "io" and e.args else "", e.path])
            n += 1
    os.replace(tmp, path)
    return n


def _read_lines(buf: bytearray) -> list[str]:
    lines = []
    while b"\n" in buf:
        i = buf.index(b"\n")
        lines.append(buf[:i].decode("utf-8", "replace"))
        del buf[:i + 1]
    return lines


def main() -> int:
    """Run the sidecar until stdin closes. Exit code 0 unless the configuration is unreadable."""
    # no SIGINT handling here: the sidecar runs in its own session (the terminal's Ctrl-C goes to
    # the job), and an ignored SIGINT would be inherited by py-spy, which stops on SIGINT
    buf = bytearray()
    cfg_line = None
    deadline = time.monotonic() + 30
    while cfg_line is None and time.monotonic() < deadline:
        r, _, _ = select.select([0], [], [], 1.0)
        if r:
            chunk = os.read(0, 65536)
            if not chunk:
                return 2
            buf += chunk
            lines = _read_lines(buf)
            if lines:
                cfg_line = lines[0]
                rest = lines[1:]
    if cfg_line is None:
        return 2
    try:
        cfg = json.loads(cfg_line)
    except ValueError:
        return 2
    sc = Sidecar(cfg)
    try:
        _send(sc.setup())
        pending = list(rest)
        while True:
            for line in pending:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                cmd = msg.get("cmd")
                if cmd == "start":
                    sc.start(int(msg.get("since_unix_ns") or time.time_ns()))
                    _send({"event": "started"})
                elif cmd == "finish":
                    try:
                        _send(sc.finish(msg["dir"], msg["window_unix_ns"], float(msg.get("trace_minus_unix_us") or 0.0)))
                    except Exception as exc:
                        _send({"event": "finished", "files": {}, "notes": [f"native export failed: {type(exc).__name__}: {exc}"]})
                elif cmd == "quit":
                    return 0
            pending = []
            r, _, _ = select.select([0], [], [], DRAIN_INTERVAL_S)
            if r:
                chunk = os.read(0, 65536)
                if not chunk:
                    return 0  # the agent (or the job) went away
                buf += chunk
                pending = _read_lines(buf)
            sc.tick()
    except BrokenPipeError:
        return 0
    finally:
        sc.close()


if __name__ == "__main__":
    sys.exit(main())
