"""Compiling the agent's small native helpers once per source version, cached on disk.

The PM sampler (pmsampling.c) and the profiler stopper (offstop.cpp) are built on first use
with the system C++ compiler, into ``~/.cache/aiprof`` (or a per-user temp folder, used only if
it is ours alone: agent/privdir.py), under a
name that hashes everything the binary depends on, so a new source, header set or torch
build gets its own file and an old one is never loaded by mistake. A build runs in a
subprocess at nice 10 (through ``nice``), bounded by a timeout; concurrent builders each write a temp file and
rename it into place (the last one wins, all identical). Standard library only.
"""
from __future__ import annotations

import atexit
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


_fallback_dir: str | None = None  # this process's own mkdtemp folder, once the shared ones were refused


def cache_dir() -> str:
    """A private folder for built helpers: ``$XDG_CACHE_HOME/aiprof`` (``~/.cache/aiprof``), else
    ``/tmp/aiprof-cache-<uid>``, each used only if it is ours alone (agent/privdir.py). One that
    another user created or can write is refused with one line on stderr, and the process builds
    into a fresh private temp folder of its own instead (slower: no cache, but the job runs on)."""
    global _fallback_dir
    from aiprof.agent import log
    from aiprof.agent.privdir import UnsafePath, ensure_private_dir

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (os.path.join(base, "aiprof"), os.path.join(tempfile.gettempdir(), f"aiprof-cache-{os.getuid()}")):
        try:
            ensure_private_dir(d)
            if os.access(d, os.W_OK):
                return d
        except UnsafePath as exc:
            log.warn_once(f"cache-dir:{d}", f"ignoring the helper cache {exc}: nothing is loaded from it "
                                            "(remove it)")
        except OSError:
            continue
    if _fallback_dir is None or not os.path.isdir(_fallback_dir):
        try:
            _fallback_dir = tempfile.mkdtemp(prefix=f"aiprof-cache-{os.getuid()}-")
        except OSError as exc:
            raise BuildError(f"no private cache folder for native helpers: {exc.strerror or exc}") from exc
        atexit.register(shutil.rmtree, _fallback_dir, True)  # a loaded helper stays mapped without its file
    return _fallback_dir


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
    from aiprof.agent.privdir import UnsafePath, check_private_file

    out = cached_path(name, key)
    if os.path.lexists(out):
        try:
            check_private_file(out)  # the folder is ours; a file in it not ours is rebuilt over
            return out
        except UnsafePath:
            pass
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
