"""Compiling the agent's small native helpers once per source version, cached on disk.

The PM sampler (pmsampling.c) and the profiler stopper (offstop.cpp) are built on first use
with the system C++ compiler, into ``~/.cache/aiprof`` (or a per-user temp folder), under a
name that hashes everything the binary depends on, so a new source, header set or torch
build gets its own file and an old one is never loaded by mistake. A build runs in a
subprocess at nice 10 (through ``nice``), bounded by a timeout; concurrent builders each write a temp file and
rename it into place (the last one wins, all identical). Standard library only.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable

BUILD_TIMEOUT_S = 120  # a cold build of either helper takes seconds; a wedged compiler must not hang us
BUILD_NICE = 10  # the build yields the CPU to the job's own threads


class BuildError(RuntimeError):
    """The helper could not be built here; ``str()`` is the one-line reason."""


def cache_dir() -> str:
    """A writable folder for built helpers (``$XDG_CACHE_HOME/aiprof``, else a per-user temp one)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (os.path.join(base, "aiprof"), os.path.join(tempfile.gettempdir(), f"aiprof-cache-{os.getuid()}")):
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise BuildError("no writable cache folder for native helpers")


def compiler() -> str:
    """The C++ compiler to use ($CXX, else c++, g++ or clang++)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise BuildError("no C++ compiler (c++, g++ or clang++)")
    return cxx


def digest(paths: Iterable[str], extra: Iterable[str] = ()) -> str:
    """A short hash of the files' contents and the extra strings (versions, flags)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    for s in extra:
        h.update(b"\0" + s.encode())
    return h.hexdigest()[:12]


def cached_path(name: str, key: str) -> str:
    """Where :func:`build_cached` puts (or finds) helper ``name`` of version ``key``."""
    return os.path.join(cache_dir(), f"{name}-{key}.so")


def build_cached(name: str, key: str, args: list[str], what: str) -> str:
    """``<cache>/<name>-<key>.so``, compiled with ``compiler() + args + ['-o', out]`` if missing.

    ``what`` names the helper in errors. Raises :class:`BuildError` with the compiler's last line.
    """
    out = cached_path(name, key)
    if os.path.exists(out):
        return out
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = [compiler(), *args, "-o", tmp]
    nice = shutil.which("nice")  # not preexec_fn: unsafe in a process with threads (the job's)
    if nice:
        cmd = [nice, "-n", str(BUILD_NICE), *cmd]
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"building the {what} failed: {type(exc).__name__}") from exc
    if r.returncode != 0:
        errors = [ln for ln in (r.stderr or r.stdout).splitlines() if "error" in ln] or \
            (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise BuildError(f"building the {what} failed: {errors[0].strip()[:200]}")
    os.replace(tmp, out)
    return out
