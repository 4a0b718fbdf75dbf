"""``aiprof run``: start a command with the agent preloaded in every Python process it spawns.

The preload is a private boot folder put first on PYTHONPATH, holding ``sitecustomize.py``
(a copy of :mod:`aiprof.agent.preload`) and an ``aiprof`` link to this package, so the job's
interpreters (torchrun's ranks included, whatever venv they use) find our agent and nothing
else of our environment. Settings travel in ``$AIPROF_AGENT`` (JSON).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

import aiprof
from aiprof.protocol import CaptureRequest
from aiprof.errors import AiprofError


def package_dir() -> str:
    """The folder of the ``aiprof`` package this CLI runs from."""
    return os.path.dirname(os.path.abspath(aiprof.__file__))


def make_boot_dir(parent: str | None = None) -> str:
    """Create a boot folder with our sitecustomize and an ``aiprof`` link; returns its path."""
    d = tempfile.mkdtemp(prefix="aiprof-boot-", dir=parent)
    os.chmod(d, 0o755)  # the job may run as another user (sudo -u ...)
    src = os.path.join(package_dir(), "agent", "preload.py")
    shutil.copyfile(src, os.path.join(d, "sitecustomize.py"))
    os.symlink(package_dir(), os.path.join(d, "aiprof"))
    return d


def agent_env(boot_dir: str, request: CaptureRequest | None, entry: str | None, rt: str | None,
              base: dict[str, str] | None = None, server: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment for the job: PYTHONPATH with the boot folder first, AIPROF_AGENT set.

    ``server``: ``{"url", "token", "out", "job"}`` makes every agent link to the service.
    """
    env = dict(os.environ if base is None else base)
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = boot_dir + (os.pathsep + old if old else "")
    cfg: dict[str, Any] = {"request": request.to_dict() if request else None, "entry": entry}
    if server:
        cfg["server"] = server
    if rt:
        cfg["runtime_dir"] = rt
        env["AIPROF_RUNTIME_DIR"] = rt
    env["AIPROF_AGENT"] = json.dumps(cfg)
    return env


class StderrTail:
    """The last TAIL_BYTES the job wrote to stderr, kept while every byte is passed on to ours.

    The job's stderr goes through a pipe, or a pseudo-terminal when ours is a terminal so the job
    still sees one (colours, progress bars); a copying thread forwards it unchanged.
    """

    TAIL_BYTES = 4096  # a traceback's last frames and its message
    # The agents' own "capture failed: <why>" lines (agent/log.warn_once), kept wherever they fall
    # in the stream: the job may write far more than the tail after them.
    FAILED_MARK = b": capture failed: "
    AGENT_PREFIX = b"aiprof agent["
    FAILURES_KEPT = 8  # distinct reasons (ranks usually share one)
    LINE_BYTES = 2048  # a longer line is no agent's

    def __init__(self) -> None:
        self.buf = bytearray()
        self.thread: threading.Thread | None = None
        self.failures: list[str] = []
        self._line = bytearray()

    def open(self) -> int:
        """The descriptor the child gets as stderr; the copying thread starts here."""
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            tty = False
        if tty:
            import pty

            read_fd, child_fd = pty.openpty()
        else:
            read_fd, child_fd = os.pipe()
        self.thread = threading.Thread(target=self._copy, args=(read_fd,), daemon=True)
        self.thread.start()
        return child_fd

    def _copy(self, fd: int) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the pseudo-terminal's last writer is gone
                    break
                if not data:
                    break
                self.buf += data
                del self.buf[:-self.TAIL_BYTES]
                self._scan(data)
                if out is not None:
                    out.write(data)
                    out.flush()
        finally:
            os.close(fd)

    def _scan(self, data: bytes) -> None:
        """Keep the reasons of the agents' failed captures, line by line as the data comes."""
        *done, rest = (bytes(self._line) + data).split(b"\n")
        for ln in done:
            ln = ln.rstrip(b"\r")
            if ln.startswith(self.AGENT_PREFIX) and self.FAILED_MARK in ln:
                why = ln.split(self.FAILED_MARK, 1)[1].decode("utf-8", "replace").strip()
                if why and why not in self.failures and len(self.failures) < self.FAILURES_KEPT:
                    self.failures.append(why)
        self._line = bytearray(rest[:self.LINE_BYTES])

    def lines(self, n: int = 5) -> list[str]:
        """The last ``n`` non-blank lines, after the job has exited."""
        if self.thread is not None:
            self.thread.join(2.0)  # a grandchild still holding the pipe must not hang us
        text = self.buf.decode("utf-8", "replace").replace("\r\n", "\n")
        return [ln for ln in text.split("\n") if ln.strip()][-n:]


def run_with_agent(cmd: list[str], request: CaptureRequest | None, entry: str | None = None,
                   rt: str | None = None, server: dict[str, Any] | None = None,
                   stderr_tail: StderrTail | None = None) -> int:
    """Run ``cmd`` with the agent preloaded; forwards SIGINT/SIGTERM; returns its exit code.
    ``stderr_tail`` keeps the end of the job's stderr (still shown as it comes)."""
    if not cmd:
        raise AiprofError("nothing to run: give a command after --, e.g. aiprof run -- python train.py")
    if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
        raise AiprofError(f"command not found: {cmd[0]}")
    boot = make_boot_dir()
    try:
        env = agent_env(boot, request, entry, rt, server=server)
        child_err = stderr_tail.open() if stderr_tail is not None else None
        try:
            proc = subprocess.Popen(cmd, env=env, stderr=child_err)
        except OSError as exc:
            raise AiprofError(f"cannot start {cmd[0]}: {exc.strerror or exc}") from exc
        finally:
            if child_err is not None:
                os.close(child_err)  # the child holds its copy: EOF reaches the reader when it exits

        def forward(signum: int, _frame: Any) -> None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return rc if rc >= 0 else 128 - rc
    finally:
        shutil.rmtree(boot, ignore_errors=True)


def list_rank_dirs(out: str, capture_id: str) -> list[str]:
    """``<out>/<capture-id>/rank*`` folders that hold a finished capture (meta.json)."""
    base = os.path.join(out, capture_id)
    if not os.path.isdir(base):
        return []
    return sorted(os.path.join(base, d) for d in os.listdir(base)
                  if d.startswith("rank") and os.path.exists(os.path.join(base, d, "meta.json")))
