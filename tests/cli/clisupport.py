"""Helpers for the CLI tests (tests/cli): the real `python -m aiprof` in a subprocess, on this checkout."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"


def cli_env(**extra: str) -> dict[str, str]:
    """This checkout's aiprof first on PYTHONPATH; no $COLUMNS or progress override inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "AIPROF_PROGRESS", "AIPROF_AGENT")}
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def aiprof(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run ``python -m aiprof ARGS`` to completion; text stdout and stderr."""
    return subprocess.run([sys.executable, "-m", "aiprof", *args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env(**env))


def aiprof_in_tty(*args: str, cols: int, rows: int = 50, timeout: float = 300, **env: str) -> tuple[int, str]:
    """Run ``python -m aiprof ARGS`` with stdout and stderr on a pseudo-terminal of ``cols`` x
    ``rows``; returns the exit code and everything written to the terminal (\\r\\n as \\n)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "aiprof", *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=cli_env(**env), close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal's last descriptor
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = proc.wait(timeout=timeout)
    return rc, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
