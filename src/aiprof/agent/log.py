"""The agent's only way to speak: one line on stderr per distinct problem, never an exception."""
from __future__ import annotations

import os
import sys
import threading

_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Print ``aiprof agent: <message>`` to stderr the first time ``key`` is seen."""
    try:
        with _lock:
            if key in _seen:
                return
            _seen.add(key)
        sys.stderr.write(f"aiprof agent[{os.getpid()}]: {message}\n")
        sys.stderr.flush()
    except Exception:  # stderr closed or odd: stay silent rather than raise into the job
        pass


def info(message: str) -> None:
    """An informational line, only when AIPROF_VERBOSE is set."""
    if os.environ.get("AIPROF_VERBOSE"):
        try:
            sys.stderr.write(f"aiprof agent[{os.getpid()}]: {message}\n")
            sys.stderr.flush()
        except Exception:
            pass


def error(where: str, exc: BaseException) -> None:
    """Report an exception caught at the agent boundary, once per place and type."""
    warn_once(f"{where}:{type(exc).__name__}", f"{where} failed ({type(exc).__name__}: {exc}); the job continues")
