"""Looking at other processes through /proc: which are Python, which version, torch loaded, may we ptrace.

Every check raises :class:`AttachError` with one line that says what is wrong and what to do.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field

from aiprof.errors import AiprofError

CAP_SYS_PTRACE = 19
MIN_VERSION = (3, 10)
_LIBPY = re.compile(r"libpython(\d+)\.(\d+)")
_EXE_VER = re.compile(r"python(\d+)\.(\d+)")


class AttachError(AiprofError):
    """A process that cannot be attached to, with the reason."""


@dataclass
class ProcessInfo:
    """What /proc tells about a process, as far as attaching goes."""

    pid: int
    comm: str
    cmdline: list[str]
    exe: str | None
    uid: int | None
    ppid: int | None
    is_python: bool = False
    version: tuple[int, int] | None = None
    torch_loaded: bool = False
    maps_readable: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"pid {self.pid} ({self.comm})"


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _status_field(pid: int | str, name: str) -> str | None:
    try:
        for line in _read(f"/proc/{pid}/status").splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def has_cap_sys_ptrace() -> bool:
    """Whether this process has CAP_SYS_PTRACE in its effective set."""
    eff = _status_field("self", "CapEff")
    try:
        return bool(int(eff or "0", 16) >> CAP_SYS_PTRACE & 1)
    except ValueError:
        return False


def ptrace_scope() -> int | None:
    """kernel.yama.ptrace_scope, or None without Yama."""
    try:
        return int(_read("/proc/sys/kernel/yama/ptrace_scope").strip())
    except (OSError, ValueError):
        return None


def is_descendant(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` descends from ``ancestor`` (walks PPid, bounded)."""
    cur = pid
    for _ in range(256):
        if cur == ancestor:
            return True
        pp = _status_field(cur, "PPid")
        if not pp or pp == "0":
            return False
        cur = int(pp)
    return False


def inspect_process(pid: int) -> ProcessInfo:
    """Read /proc/<pid>; raises AttachError if there is no such process."""
    if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
        raise AttachError(f"no such process: {pid}")
    try:
        comm = _read(f"/proc/{pid}/comm").strip()
        cmdline = [a for a in _read(f"/proc/{pid}/cmdline").split("\0") if a]
    except FileNotFoundError:
        raise AttachError(f"no such process: {pid}") from None
    except OSError as exc:
        raise AttachError(f"cannot read /proc/{pid}: {exc.strerror}") from exc
    uid_s = _status_field(pid, "Uid")
    pp = _status_field(pid, "PPid")
    info = ProcessInfo(pid, comm, cmdline, None, int(uid_s.split()[1]) if uid_s else None, int(pp) if pp else None)
    try:
        info.exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    try:
        maps = _read(f"/proc/{pid}/maps")
    except PermissionError:
        info.maps_readable = False
        maps = ""
    except OSError:
        maps = ""
    m = _LIBPY.search(maps)
    exe_base = os.path.basename(info.exe or (cmdline[0] if cmdline else ""))
    if m:
        info.is_python, info.version = True, (int(m.group(1)), int(m.group(2)))
    elif exe_base.startswith("python") or comm.startswith("python"):
        info.is_python = True
        m2 = _EXE_VER.search(exe_base)
        if m2:
            info.version = (int(m2.group(1)), int(m2.group(2)))
    info.torch_loaded = "libtorch_python" in maps or "/torch/_C." in maps
    if info.is_python and info.version is None and info.exe:
        info.version = _ask_version(info.exe)
    return info


def _ask_version(exe: str) -> tuple[int, int] | None:
    """Ask a Python executable its version (isolated, no site), bounded by a timeout."""
    try:
        out = subprocess.run([exe, "-I", "-S", "-c", "import sys; print('%d %d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=10)
        a, b = out.stdout.split()
        return int(a), int(b)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def check_ptrace_allowed(info: ProcessInfo) -> None:
    """Raise AttachError saying which permission is missing to ptrace ``info.pid``."""
    if os.geteuid() == 0 and has_cap_sys_ptrace():
        scope = ptrace_scope()
        if scope == 3:
            raise AttachError(f"{info.label}: ptrace is disabled on this host (kernel.yama.ptrace_scope=3, "
                              "only a reboot clears it)")
        return
    cap = has_cap_sys_ptrace()
    scope = ptrace_scope()
    if scope == 3:
        raise AttachError(f"{info.label}: ptrace is disabled on this host (kernel.yama.ptrace_scope=3)")
    if info.uid is not None and info.uid != os.geteuid() and not cap:
        raise AttachError(f"{info.label}: no permission: it runs as uid {info.uid} and you as uid {os.geteuid()}; "
                          "attaching needs the same user or CAP_SYS_PTRACE (e.g. run aiprof as root)")
    if cap:
        return
    if scope == 2:
        raise AttachError(f"{info.label}: no permission: kernel.yama.ptrace_scope=2 lets only CAP_SYS_PTRACE attach; "
                          "run aiprof as root (or sysctl kernel.yama.ptrace_scope=0)")
    if scope == 1 and not is_descendant(info.pid, os.getpid()):
        raise AttachError(f"{info.label}: no permission: kernel.yama.ptrace_scope=1 allows attaching only to your "
                          "own child processes; needs CAP_SYS_PTRACE (run as root) or sysctl kernel.yama.ptrace_scope=0")


def check_attachable(info: ProcessInfo, need_torch: bool = True) -> None:
    """All checks before injecting: Python, version, permission, torch imported."""
    if not info.maps_readable:
        check_ptrace_allowed(info)
        raise AttachError(f"{info.label}: no permission to read /proc/{info.pid}/maps; needs the same user "
                          "or CAP_SYS_PTRACE")
    if not info.is_python:
        raise AttachError(f"{info.label} is not a CPython process (no libpython, executable {info.exe})")
    if info.version is None:
        raise AttachError(f"{info.label}: cannot tell its Python version")
    if info.version < MIN_VERSION:
        raise AttachError(f"{info.label} runs Python {info.version[0]}.{info.version[1]}; attach supports 3.10 or newer")
    check_ptrace_allowed(info)
    if need_torch and not info.torch_loaded:
        raise AttachError(f"{info.label}: torch is not imported in the target (no libtorch_python in its memory map); "
                          "attach once it has imported torch, or start it with aiprof run")


def _ancestors() -> set[int]:
    out = {os.getpid()}
    cur = os.getpid()
    for _ in range(256):
        pp = _status_field(cur, "PPid")
        if not pp or pp == "0":
            break
        cur = int(pp)
        out.add(cur)
    return out


def is_launcher_or_helper(cmdline: list[str]) -> bool:
    """torchrun launchers and multiprocessing helpers: never picked by name."""
    joined = " ".join(cmdline)
    return ("torch.distributed.run" in joined or "torch.distributed.launch" in joined
            or any(os.path.basename(a) == "torchrun" for a in cmdline[:2])
            or "--multiprocessing-fork" in cmdline or "multiprocessing.resource_tracker" in joined
            or "multiprocessing.forkserver" in joined)


def resolve_targets(specs: list[str]) -> list[int]:
    """PIDs for ``PID`` or ``NAME`` arguments. A NAME matches Python processes whose name or
    command line contains it (not this process, its ancestors, launchers or helpers)."""
    pids: list[int] = []
    skip = _ancestors()
    for spec in specs:
        if spec.isdigit():
            pids.append(int(spec))
            continue
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in skip:
                continue
            try:
                comm = _read(f"/proc/{entry}/comm").strip()
                cmd = [a for a in _read(f"/proc/{entry}/cmdline").split("\0") if a]
            except OSError:
                continue
            if not cmd or not (spec == comm or spec in " ".join(cmd)):
                continue
            if is_launcher_or_helper(cmd):
                continue
            exe = os.path.basename(cmd[0])
            if not (exe.startswith("python") or comm.startswith("python")):
                try:
                    if "libpython" not in _read(f"/proc/{entry}/maps"):
                        continue
                except OSError:
                    continue
            found.append(int(entry))
        if not found:
            raise AttachError(f"no running Python process matches {spec!r}")
        pids.extend(sorted(found))
    seen: set[int] = set()
    return [p for p in pids if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]
