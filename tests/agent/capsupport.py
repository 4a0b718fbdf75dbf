"""Helpers shared by the capture tests (tests/agent, tests/attach): run aiprof, read captures."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tests import procs

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_train.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
PY = sys.executable


def env_with(rt: str, **extra: str) -> dict[str, str]:
    """Environment for a child: private agent runtime folder, aiprof importable."""
    env = dict(os.environ)
    env["AIPROF_RUNTIME_DIR"] = rt
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("AIPROF_AGENT", None)
    env.update(extra)
    return env


def aiprof(rt: str, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m aiprof ARGS`` and return the finished process (text output)."""
    return subprocess.run([PY, "-m", "aiprof", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or env_with(rt))


def rank_dirs(out: Path, capture_id: str | None = None) -> list[Path]:
    """rank* folders with a meta.json under out/<capture-id> (any id if None)."""
    pat = f"{capture_id or '*'}/rank*/meta.json"
    return sorted(p.parent for p in out.glob(pat))


def load_trace(rank_dir: Path) -> dict[str, Any]:
    """The Kineto JSON of a capture (must be valid gzip + JSON)."""
    with gzip.open(rank_dir / "trace.json.gz", "rt") as f:
        return json.load(f)


def load_meta(rank_dir: Path) -> dict[str, Any]:
    return json.loads((rank_dir / "meta.json").read_text())


def profiler_steps(trace: dict[str, Any]) -> list[int]:
    """Iteration numbers of the CPU-side ProfilerStep#N annotations."""
    return sorted({int(e["name"].split("#", 1)[1]) for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("ProfilerStep#")})


def categories(trace: dict[str, Any]) -> set[str]:
    return {e.get("cat") for e in trace["traceEvents"] if e.get("ph") == "X"}


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``pred`` until truthy; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def torch_loaded(pid: int) -> bool:
    try:
        return "libtorch_python" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    """Terminate a child we started (bounded)."""
    procs.stop(proc)
