"""Helpers of the service tests: the real ``aiprof server`` as a subprocess on 127.0.0.1.

A module of its own (not conftest.py) so that ``from srvsupport import ...`` finds it when
tests/server runs together with other test folders that have their own conftest.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiprof.server.client import ServerClient

PY = sys.executable
SCRIPTS = Path(__file__).parent / "scripts"


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    token: str
    data: Path

    def client(self, token: str | None = "__own__", timeout: float = 10.0) -> ServerClient:
        return ServerClient(self.url, self.token if token == "__own__" else token, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data: Path, port: int = 0, *extra: str) -> Server:
    """Start ``aiprof server`` and wait (bounded) until it has written DATA/server.json."""
    info = data / "server.json"
    if info.exists():
        info.unlink()
    log = open(data.parent / f"{data.name}-server-{time.time_ns()}.log", "wb")
    proc = subprocess.Popen([PY, "-m", "aiprof", "server", "--data", str(data), "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not info.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            raise AssertionError("aiprof server did not start: " + Path(log.name).read_text()[-2000:])
        time.sleep(0.05)
    url = json.loads(info.read_text())["url"]
    return Server(proc, url, (data / "token").read_text().strip(), data)


def kill_group(p: subprocess.Popen) -> None:
    """End a process started with start_new_session=True and all of its children."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)
