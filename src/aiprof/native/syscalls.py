"""Which system calls a process's threads wait in: sampled from ``/proc/PID/task/TID/syscall``.

The kernel reports, for a thread blocked in a system call, its number and arguments; for a
thread on a CPU, ``running``. Sampling every thread every ``interval`` therefore measures the
time threads spend *blocked* in each system call (futex waits, reads waiting for the disk or a
pipe, epoll/poll waits, ioctls waiting on the driver), with the resolution of the interval. A
system call that completes without sleeping (a read served from the page cache) is on a CPU,
reads as ``running`` and is not seen: docs/capture.md says so. Consecutive samples of one
thread in the same call with the same arguments are one *episode*: a lower bound on the
number of calls and an estimate of each one's length (samples × interval).
"""
from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Any

DEFAULT_INTERVAL_S = 0.002  # 500 Hz: ~2-4% of one core for a 10-thread job, 2 ms resolution
MIN_INTERVAL_S = 0.0005  # below this the sampler's own reads dominate the core it runs on
TASK_RESCAN_S = 0.25  # new threads (a DataLoader's pin thread) are picked up this often
MAX_SAMPLES = 2_000_000  # ~100 MB of tuples at most; a longer capture keeps its first samples

_X86_64 = {0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 7: "poll", 8: "lseek",
           9: "mmap", 10: "mprotect", 11: "munmap", 12: "brk", 13: "rt_sigaction", 14: "rt_sigprocmask",
           16: "ioctl", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev", 23: "select",
           24: "sched_yield", 28: "madvise", 32: "dup", 35: "nanosleep", 39: "getpid", 41: "socket",
           42: "connect", 43: "accept", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg",
           56: "clone", 57: "fork", 59: "execve", 61: "wait4", 62: "kill", 72: "fcntl", 74: "fsync",
           75: "fdatasync", 202: "futex", 217: "getdents64", 230: "clock_nanosleep", 232: "epoll_wait",
           257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4",
           290: "eventfd2", 295: "preadv", 296: "pwritev", 299: "recvmmsg", 307: "sendmmsg",
           435: "clone3", 441: "epoll_pwait2", 449: "futex_waitv"}
_AARCH64 = {17: "getcwd", 23: "dup", 25: "fcntl", 29: "ioctl", 56: "openat", 57: "close", 61: "getdents64",
            62: "lseek", 63: "read", 64: "write", 65: "readv", 66: "writev", 67: "pread64", 68: "pwrite64",
            69: "preadv", 70: "pwritev", 72: "pselect6", 73: "ppoll", 82: "fsync", 83: "fdatasync",
            98: "futex", 101: "nanosleep", 115: "clock_nanosleep", 124: "sched_yield", 198: "socket",
            203: "connect", 202: "accept", 206: "sendto", 207: "recvfrom", 211: "sendmsg", 212: "recvmsg",
            215: "munmap", 220: "clone", 222: "mmap", 226: "mprotect", 233: "madvise", 242: "accept4",
            260: "wait4", 22: "epoll_pwait", 441: "epoll_pwait2", 449: "futex_waitv"}
SYSCALL_NAMES = _AARCH64 if platform.machine() in ("aarch64", "arm64") else _X86_64

#: Syscall name -> class, for the root-cause model (docs/findings.md, "Blocked in system calls").
SYSCALL_CLASS = {
    **{n: "io" for n in ("read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev",
                         "open", "openat", "close", "stat", "fstat", "lseek", "fsync", "fdatasync",
                         "getdents64", "recvfrom", "recvmsg", "recvmmsg", "sendto", "sendmsg", "sendmmsg",
                         "connect", "accept", "accept4")},
    **{n: "lock" for n in ("futex", "futex_waitv")},
    **{n: "poll" for n in ("poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait", "epoll_pwait2")},
    **{n: "sleep" for n in ("nanosleep", "clock_nanosleep", "sched_yield")},
    **{n: "driver" for n in ("ioctl",)},
    **{n: "memory" for n in ("mmap", "munmap", "mprotect", "madvise", "brk")},
    **{n: "process" for n in ("wait4", "clone", "clone3", "fork", "execve")},
}


def syscall_name(nr: int) -> str:
    """The name of system call ``nr`` on this machine's architecture (``syscall_<nr>`` if unknown)."""
    return SYSCALL_NAMES.get(nr, f"syscall_{nr}")


def syscall_class(name: str) -> str:
    """io | lock | poll | sleep | driver | memory | process | other."""
    return SYSCALL_CLASS.get(name, "other")


def parse_syscall_line(text: str) -> tuple[int, list[int]] | None:
    """``/proc/.../syscall`` content -> (number, [arg0..arg5]) when blocked in a call, else None."""
    parts = text.split()
    if not parts or parts[0] == "running":
        return None
    try:
        nr = int(parts[0])
    except ValueError:
        return None
    if nr < 0:  # blocked, but not in a system call (a page fault)
        return None
    args = []
    for p in parts[1:7]:
        try:
            args.append(int(p, 16))
        except ValueError:
            args.append(0)
    return nr, args


@dataclass
class Episode:
    """Consecutive samples of one thread in one system call with the same arguments."""

    tid: int
    nr: int
    args: tuple[int, ...]
    first_ns: int
    last_ns: int
    samples: int = 1
    path: str = ""


@dataclass
class SyscallSampler:
    """A thread that samples every thread of ``pid``; :meth:`stop` returns the episodes."""

    pid: int
    interval_s: float = DEFAULT_INTERVAL_S
    episodes: list[Episode] = field(default_factory=list)
    thread_names: dict[int, str] = field(default_factory=dict)
    samples: int = 0
    ticks: int = 0
    errors: list[str] = field(default_factory=list)
    truncated: bool = False

    def __post_init__(self) -> None:
        self.interval_s = max(MIN_INTERVAL_S, float(self.interval_s))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._open: dict[int, Episode] = {}
        self._fds: dict[tuple[int, int], str] = {}
        self.started_ns = 0
        self.stopped_ns = 0

    def start(self) -> None:
        """Begin sampling (a daemon thread of the caller's process)."""
        self.started_ns = time.time_ns()
        self._thread = threading.Thread(target=self._run, name="aiprof-syscalls", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> list[Episode]:
        """Stop, close open episodes and return all of them (time order of their start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.stopped_ns = time.time_ns()
        self.episodes.extend(self._open.values())
        self._open.clear()
        self.episodes.sort(key=lambda e: e.first_ns)
        return self.episodes

    def _tasks(self) -> list[int]:
        try:
            return [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except (OSError, ValueError):
            return []

    def _name(self, tid: int) -> None:
        try:
            with open(f"/proc/{self.pid}/task/{tid}/comm") as f:
                self.thread_names[tid] = f.read().strip()
        except OSError:
            pass

    def _fd_path(self, nr: int, fd: int) -> str:
        name = syscall_name(nr)
        if syscall_class(name) != "io" or not 0 <= fd < 1 << 20:
            return ""
        key = (nr, fd)
        p = self._fds.get(key)
        if p is None:
            try:
                p = os.readlink(f"/proc/{self.pid}/fd/{fd}")
            except OSError:
                p = ""
            self._fds[key] = p
        return p

    def _run(self) -> None:
        tasks: list[int] = []
        files: dict[int, Any] = {}
        next_scan = 0.0
        nxt = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            if now >= next_scan:
                tasks = self._tasks()
                if not tasks and not os.path.exists(f"/proc/{self.pid}"):
                    break  # the process exited
                for t in tasks:
                    if t not in self.thread_names:
                        self._name(t)
                for t in list(files):
                    if t not in tasks:
                        try:
                            files.pop(t).close()
                        except OSError:
                            pass
                        self._close_episode(t)
                next_scan = now + TASK_RESCAN_S
            t_ns = time.time_ns()
            self.ticks += 1
            for tid in tasks:
                f = files.get(tid)
                try:
                    if f is None:
                        f = files[tid] = open(f"/proc/{self.pid}/task/{tid}/syscall", "rb", buffering=0)
                    f.seek(0)
                    text = f.read(256).decode("ascii", "replace")
                except OSError as exc:
                    if len(self.errors) < 5 and getattr(exc, "errno", 0) not in (2, 3):  # gone: not an error
                        self.errors.append(f"/proc/{self.pid}/task/{tid}/syscall: {exc.strerror or exc}")
                    files.pop(tid, None)
                    self._close_episode(tid)
                    continue
                self.samples += 1
                parsed = parse_syscall_line(text)
                if parsed is None:
                    self._close_episode(tid)
                    continue
                nr, args = parsed
                ep = self._open.get(tid)
                key = tuple(args)
                if ep is not None and ep.nr == nr and ep.args == key:
                    ep.last_ns = t_ns
                    ep.samples += 1
                    continue
                self._close_episode(tid)
                if len(self.episodes) + len(self._open) >= MAX_SAMPLES:
                    self.truncated = True
                    continue
                self._open[tid] = Episode(tid, nr, key, t_ns, t_ns, 1, self._fd_path(nr, args[0] if args else -1))
            nxt += self.interval_s
            delay = nxt - time.perf_counter()
            if delay < 0:
                nxt = time.perf_counter()  # fell behind (a loaded machine): no burst to catch up
                delay = 0.0
            self._stop.wait(delay)
        for f in files.values():
            try:
                f.close()
            except OSError:
                pass

    def _close_episode(self, tid: int) -> None:
        ep = self._open.pop(tid, None)
        if ep is not None:
            self.episodes.append(ep)
