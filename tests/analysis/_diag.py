"""Helpers shared by the diagnosis tests (not collected: no test_ prefix)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_trace(out: Path, slow_step: int = -1, steps: int = 8) -> Path:
    """Profile examples/tiny_train.py on the CPU with real torch.profiler; return the trace path."""
    path = out / "trace.json.gz"
    cmd = [sys.executable, str(ROOT / "examples" / "tiny_train.py"), "--steps", str(steps), "--profile", str(path)]
    if slow_step >= 0:
        cmd += ["--slow-step", str(slow_step), "--slow-ms", "60"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return path
