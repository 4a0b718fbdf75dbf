"""The agent's handle on its native sidecar (aiprof.native.sidecar): start, wait ready, start
recording, finish into the capture folder. Everything here is bounded: a sidecar that does not
answer in time is noted in meta.json and the capture goes on without its data.

The sidecar is a child of the job, and attaches to its parent: where Yama restricts ptrace to
descendants (ptrace_scope 1), the job first names the sidecar its ptracer (PR_SET_PTRACER).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from aiprof.agent import log

READY_TIMEOUT_S = 30.0  # Frida's attach and the first hook pass take 1-5 s on a loaded host
NATIVE_NO_STEPS_S = 2.0  # a job with no steps gets its sidecar this long after the request
FINISH_TIMEOUT_S = 60.0  # writing calls.csv for a million calls, and py-spy's own flush
PR_SET_PTRACER = 0x59616D61


def _allow_ptrace_by(pid: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, pid, 0, 0, 0)
    except Exception:
        pass  # no Yama, or no prctl: nothing to allow


class NativeSidecar:
    """One sidecar process for this job; reused by later captures with the same settings."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None
        self.ready: dict[str, Any] | None = None
        self.error: str | None = None
        self._q: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None

    def launch(self) -> None:
        """Start the sidecar (returns at once; :meth:`wait_ready` waits for its hooks)."""
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for k in ("LD_PRELOAD", "PYTHONSTARTUP", "AIPROF_AGENT", "AIPROF_AUTO"):
            env.pop(k, None)  # the sidecar is no job: no agent in it (it never imports torch either)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "aiprof.native.sidecar"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                         start_new_session=True, close_fds=True)
        except OSError as exc:
            self.error = f"native sidecar did not start: {exc}"
            return
        _allow_ptrace_by(self.proc.pid)
        self._reader = threading.Thread(target=self._read, name="aiprof-native", daemon=True)
        self._reader.start()
        self._send({**self.cfg, "pid": os.getpid()})

    def _read(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            try:
                self._q.put(json.loads(line))
            except ValueError:
                continue
        self._q.put({"event": "exited", "rc": proc.wait()})

    def _send(self, obj: dict[str, Any]) -> bool:
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except Exception as exc:
            self.error = f"native sidecar: {type(exc).__name__}: {exc}"
            return False

    def _wait(self, event: str, timeout: float) -> dict[str, Any] | None:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            try:
                msg = self._q.get(timeout=left)
            except queue.Empty:
                return None
            if msg.get("event") == event:
                return msg
            if msg.get("event") == "exited":
                self.error = f"native sidecar exited (rc {msg.get('rc')})"
                return None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """True once the sidecar reported its hooks (or that it has none to set)."""
        if self.ready is not None:
            return True
        if self.proc is None:
            return False
        msg = self._wait("ready", timeout)
        if msg is None:
            self.error = self.error or f"native sidecar not ready in {timeout:.0f} s"
            return False
        self.ready = msg
        for n in msg.get("notes") or []:
            log.warn_once(f"native-{n[:40]}", n)
        return True

    def poll_ready(self) -> bool:
        """Non-blocking :meth:`wait_ready` (the control thread polls it)."""
        if self.ready is not None:
            return True
        try:
            while True:
                msg = self._q.get_nowait()
                if msg.get("event") == "ready":
                    self.ready = msg
                    for n in msg.get("notes") or []:
                        log.warn_once(f"native-{n[:40]}", n)
                    return True
                if msg.get("event") == "exited":
                    self.error = f"native sidecar exited (rc {msg.get('rc')})"
                    return False
        except queue.Empty:
            return False

    def start_recording(self, since_unix_ns: int) -> bool:
        """Tell the sidecar the capture records from ``since_unix_ns`` on. Does not wait (it runs
        on the training thread): one short write to a pipe."""
        if self.ready is None:
            return False
        return self._send({"cmd": "start", "since_unix_ns": since_unix_ns})

    def finish(self, d: str, window_unix_ns: list[int], offset_us: float) -> dict[str, Any]:
        """Have the sidecar write its files into ``d``; returns its report (or why none)."""
        if self.ready is None:
            return {"files": {}, "notes": [self.error or "native sidecar not ready"]}
        if not self._send({"cmd": "finish", "dir": d, "window_unix_ns": window_unix_ns,
                           "trace_minus_unix_us": offset_us}):
            return {"files": {}, "notes": [self.error or "native sidecar gone"]}
        msg = self._wait("finished", FINISH_TIMEOUT_S)  # "started" replies before it are skipped
        if msg is None:
            return {"files": {}, "notes": [self.error or f"native sidecar did not finish in {FINISH_TIMEOUT_S:.0f} s"]}
        msg.pop("event", None)
        return msg

    def close(self, kill: bool = False) -> None:
        """Let the sidecar go (it unhooks and detaches when its stdin closes); ``kill``: at once."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            if kill:
                p.kill()
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=10)
        except Exception:
            try:
                p.kill()
            except Exception:
                pass


_SIDECAR: NativeSidecar | None = None
_LOCK = threading.Lock()


def sidecar_for(cfg: dict[str, Any]) -> NativeSidecar:
    """The job's sidecar for these settings: reused when they match, else a fresh one."""
    global _SIDECAR
    with _LOCK:
        cur = _SIDECAR
        if cur is not None and cur.cfg == cfg and cur.proc is not None and cur.proc.poll() is None:
            return cur
        if cur is not None:
            cur.close()
        _SIDECAR = NativeSidecar(cfg)
        _SIDECAR.launch()
        return _SIDECAR
