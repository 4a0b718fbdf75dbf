"""Stack dumps of running Python processes through py-spy: plain data for the hang analysis.

:func:`dump_stacks` returns, per process::

    {"pid": 123, "ok": True, "error": None, "threads": [
        {"thread_id": 1403.., "os_thread_id": 123, "name": "MainThread", "active": True,
         "owns_gil": False, "frames": [{"function": "train_step", "file": "/x/train.py",
                                       "line": 42, "native": False}, ...]}]}

Frames are innermost first, as py-spy prints them. ``native=True`` asks py-spy to merge native
(C/C++) frames, where it can unwind them.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from aiprof.termtext import visible
from aiprof.tools import find_py_spy


def _frames(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for f in raw or []:
        fn = f.get("filename") or ""
        out.append({"function": f.get("name"), "file": fn, "line": f.get("line"),
                    "module": f.get("module"), "native": bool(f.get("module")) or fn.endswith((".so", ".c", ".cpp", ".cc", ".h"))})
    return out


def _error_text(pid: int, err: str) -> str:
    low = err.lower()
    if "no such process" in low or "failed to find process" in low or not os.path.exists(f"/proc/{pid}"):
        return "no such process"
    if "permission" in low or "operation not permitted" in low:
        return "no permission: py-spy needs the same user or CAP_SYS_PTRACE (run as root)"
    if "python" in low and ("not" in low or "failed to find" in low):
        return "not a Python process (py-spy found no interpreter)"
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip().startswith("Error:")]
    return lines[0][len("Error:"):].strip() if lines else (err.strip().splitlines() or ["py-spy failed"])[0]


def dump_one(pid: int, native: bool = False, timeout: float = 20.0, py_spy: str | None = None) -> dict[str, Any]:
    """Dump all threads of one process; never raises for a per-process failure."""
    exe = py_spy or find_py_spy()
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if native:
        cmd.append("--native")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"pid": pid, "ok": False, "error": f"py-spy timed out after {timeout:.0f} s", "threads": []}
    if r.returncode != 0 or not r.stdout.strip():
        if native and "native" in (r.stderr or "").lower():
            res = dump_one(pid, False, timeout, exe)  # native unwinding unsupported here: Python only
            res["native_error"] = (r.stderr or "").strip().splitlines()[-1:]
            return res
        return {"pid": pid, "ok": False, "error": _error_text(pid, r.stderr or r.stdout), "threads": []}
    try:
        data = json.loads(r.stdout)
    except ValueError:
        return {"pid": pid, "ok": False, "error": "py-spy printed no JSON", "threads": []}
    threads = []
    for t in data if isinstance(data, list) else []:
        threads.append({"thread_id": t.get("thread_id"), "os_thread_id": t.get("os_thread_id"),
                        "name": t.get("thread_name"), "active": t.get("active"), "owns_gil": t.get("owns_gil"),
                        "frames": _frames(t.get("frames", []))})
    return {"pid": pid, "ok": True, "error": None, "native": native, "threads": threads}


def dump_stacks(pids: list[int], native: bool = False, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Dump every process in ``pids``; one dict per pid (see the module doc)."""
    exe = find_py_spy()
    return [dump_one(p, native, timeout, exe) for p in pids]


def format_text(dumps: list[dict[str, Any]]) -> str:
    """Human-readable rendering: per process, per thread, innermost frame first."""
    lines: list[str] = []
    for d in dumps:
        if not d["ok"]:
            lines.append(f"pid {d['pid']}: error: {d['error']}")
            continue
        lines.append(f"pid {d['pid']}: {len(d['threads'])} thread(s)")
        for t in d["threads"]:
            flags = ", ".join(k for k in ("active", "owns_gil") if t.get(k))
            lines.append(f"  thread {t['os_thread_id']} {t['name'] or ''}" + (f" ({flags})" if flags else ""))
            for f in t["frames"]:
                where = f"{f['file']}:{f['line']}" if f["line"] else f["file"]
                lines.append(f"    {f['function']} ({where})" + (" [native]" if f["native"] else ""))
        lines.append("")
    # function, file and thread names come from the process: no control character reaches the terminal
    return "\n".join(visible(line) for line in lines)
