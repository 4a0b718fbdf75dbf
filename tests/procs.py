"""Child processes the tests start: stopped the same bounded way everywhere."""
from __future__ import annotations

import subprocess

STOP_WAIT_S = 10  # SIGTERM's grace before SIGKILL; a killed child is reaped within as long


def stop(proc: subprocess.Popen) -> None:
    """Terminate a child we started (bounded): SIGTERM, then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_WAIT_S)
