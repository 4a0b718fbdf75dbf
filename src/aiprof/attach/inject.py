"""Getting the agent into a running CPython: ``sys.remote_exec`` (3.14+) or a shim library.

Methods, first that applies:

1. Python 3.14+: the target's own interpreter runs ``sys.remote_exec(pid, script)``.
2. 3.10+: the shim (shim.c, built once with the system C compiler and cached) is loaded into
   the target by pyinjector (a ptrace-based ``dlopen``); its constructor schedules the script
   with ``Py_AddPendingCall``.
3. Same shim, loaded by Frida (``Module.load``) when pyinjector is not installed.
4. Same shim, loaded by ``gdb -p PID -batch -ex 'call (void*)dlopen(...)'`` when pyinjector is
   not installed.

The script (written next to the shim copy) adds our package to the target's sys.path, starts
the agent (:func:`aiprof.agent.bootstrap.start_attached`) and writes a status file, which
:func:`inject_agent` waits for (bounded). Every attach uses fresh file names, because dlopen
of a path already loaded would not run the constructor again.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from aiprof.agent import cbuild
from aiprof.agent.privdir import UnsafePath, check_private_file, ensure_private_dir
from aiprof.attach.launch import package_dir
from aiprof.attach.procs import AttachError, ProcessInfo, check_ptrace_allowed
from aiprof.errors import AiprofError

SCRIPT = """\
# written by aiprof attach; runs on the target's main thread
import json as _json, os as _os, sys as _sys
_cfg = _json.loads({cfg!r})
try:  # the main thread runs Python again: the CLI now waits for the agent's start, not for this
    open(_cfg["status_path"] + ".begun", "w").close()
except Exception:
    pass
try:
    if "aiprof.agent.bootstrap" not in _sys.modules:
        _sys.path.insert(0, _cfg["lib"])
        try:
            import aiprof.agent.bootstrap
        finally:
            if _cfg["lib"] in _sys.path:
                _sys.path.remove(_cfg["lib"])
    _sys.modules["aiprof.agent.bootstrap"].start_attached(_cfg)
except BaseException as _e:
    try:
        with open(_cfg["status_path"], "w") as _f:
            _f.write(_json.dumps({{"ok": False, "pid": _os.getpid(), "error": "agent import failed: %s: %s" % (type(_e).__name__, _e)}}))
    except Exception:
        pass
"""


@dataclass
class InjectResult:
    """What one injection did."""

    pid: int
    method: str
    status: dict[str, Any]


def shim_source() -> str:
    return os.path.join(package_dir(), "attach", "shim.c")


def build_shim() -> str:
    """Compile shim.c once per source version (cached); returns the .so path."""
    pre = os.environ.get("AIPROF_SHIM")
    if pre and os.path.exists(pre):  # a shim built elsewhere (hosts without a compiler)
        return pre
    src = shim_source()
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    try:
        out = os.path.join(cbuild.cache_dir(), f"shim-{digest}.so")
    except cbuild.BuildError as exc:
        raise AttachError(str(exc)) from None
    if os.path.lexists(out):
        try:
            check_private_file(out)  # the folder is ours alone; a file in it not ours is rebuilt over
            return out
        except UnsafePath:
            pass
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise AttachError("no C compiler (cc, gcc or clang) to build the injection shim; install one, "
                          "or attach to Python 3.14+ (sys.remote_exec needs none)")
    tmp = out + f".{os.getpid()}.tmp"
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, src, "-ldl"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AttachError(f"building the injection shim failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    os.replace(tmp, out)
    return out


RT_MODE = 0o711  # our runtime folder: a target of another uid may pass through to lib/, never list it
STAGE_MODE = 0o711  # <rt>/attach: one private folder per attach inside, found by no one else
SHARED_STAGE_MODE = 0o733  # without root, a target of another uid must create its status file in it


def _private_rt(rt: str) -> str:
    """``rt`` checked as ours alone (a folder another user pre-created is refused), mode 0711."""
    try:
        ensure_private_dir(rt)
        os.chmod(rt, RT_MODE)  # let a target of another uid reach lib/ (sockets stay 0600)
    except UnsafePath as exc:
        raise AttachError(f"the runtime folder {exc}; remove it (or set AIPROF_RUNTIME_DIR to a folder "
                          "of yours)") from None
    return rt


def lib_dir(rt: str) -> str:
    """A folder holding only an ``aiprof`` link to this package (what the target imports)."""
    _private_rt(rt)
    d = os.path.join(rt, "lib")
    try:
        ensure_private_dir(d, 0o755)
    except UnsafePath as exc:
        raise AttachError(f"{exc}: not ours alone; remove it") from None
    link = os.path.join(d, "aiprof")
    want = package_dir()
    if not (os.path.islink(link) and os.readlink(link) == want):
        tmp = link + f".{os.getpid()}"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.symlink(want, tmp)
        os.replace(tmp, link)
    return d


def _write_private(path: str, text: str) -> None:
    """Create ``path`` 0600 from the start (no moment at which another user could open it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _stage(info: ProcessInfo, rt: str, agent_rt: str, entry: str | None,
           server: dict | None = None) -> tuple[str, str, str]:
    """Write the shim copy, script and status path for one target; returns (so, py, status).

    Each attach gets a fresh private folder (mkdtemp) in ``<rt>/attach``; the script, which
    holds the server token when there is one, is 0600 and owned by the target's user (handed
    over with chown when we are root and the target runs as someone else).
    """
    lib = lib_dir(rt)
    stage_root = os.path.join(rt, "attach")
    try:
        ensure_private_dir(stage_root)
        os.chmod(stage_root, STAGE_MODE)  # also tightens the 1777 folder older versions left
    except UnsafePath as exc:
        raise AttachError(f"{exc}: not ours alone; remove it") from None
    stage = tempfile.mkdtemp(prefix=f"{info.pid}-", dir=stage_root)
    stem = os.path.join(stage, f"attach-{info.pid}-{secrets.token_hex(4)}")
    so, py, status = stem + ".so", stem + ".py", stem + ".status.json"
    if any(c in stem for c in "'\\\"\n"):
        os.rmdir(stage)
        raise AttachError(f"runtime folder path {rt!r} has quotes or backslashes; set AIPROF_RUNTIME_DIR")
    other_uid = info.uid is not None and info.uid != os.geteuid()
    if other_uid and os.geteuid() != 0 and server:
        os.rmdir(stage)
        raise AttachError(f"{info.label} runs as uid {info.uid}: handing it the server token privately needs root "
                          "(to chown the staging script); attach as root or as that user")
    cfg = {"lib": lib, "status_path": status, "runtime_dir": agent_rt, "entry": entry, "server": server}
    _write_private(py, SCRIPT.format(cfg=json.dumps(cfg)))
    if info.version is None or info.version < (3, 14):
        shutil.copyfile(build_shim(), so)
        os.chmod(so, 0o755)
    if other_uid:  # the target reads the script and writes its status file here
        if os.geteuid() == 0:
            os.chown(stage, info.uid, -1)  # type: ignore[arg-type]
            os.chown(py, info.uid, -1)  # type: ignore[arg-type]
        else:  # no token in the script (refused above); the folder's name is known to no one else
            os.chmod(py, 0o644)
            os.chmod(stage, SHARED_STAGE_MODE)
    return so, py, status


def _inject_remote_exec(info: ProcessInfo, py: str) -> None:
    exe = info.exe or "python3"
    r = subprocess.run([exe, "-I", "-S", "-c", f"import sys; sys.remote_exec({info.pid}, {py!r})"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise AttachError(f"{info.label}: sys.remote_exec failed: {(r.stderr or '').strip().splitlines()[-1:]}")


_IMPORT_FRAMES = {"_find_and_load", "_find_and_load_unlocked", "_load_unlocked"}


def wait_until_not_importing(pid: int, timeout: float = 30.0) -> bool:
    """Wait (bounded) until no thread of ``pid`` is inside an import, as py-spy sees it.

    A library injected while the target is loading shared libraries (``import torch`` does
    hundreds of dlopen calls) can deadlock on the dynamic loader's lock: seen here, pyinjector
    then never returns. Returns False if still importing at the deadline; True if idle or if
    py-spy is not available to tell.
    """
    from aiprof.attach.stacks import dump_one, find_py_spy

    try:
        exe = find_py_spy()
    except AiprofError:
        return True
    deadline = time.monotonic() + timeout
    while True:
        d = dump_one(pid, timeout=10, py_spy=exe)
        if not d["ok"]:
            return True  # let the injection report the real problem
        busy = any(f["function"] in _IMPORT_FRAMES and str(f["file"]).startswith("<frozen importlib")
                   for t in d["threads"] for f in t["frames"])
        if not busy:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


INJECT_TIMEOUT_S = 30.0
AGENT_START_TIMEOUT_S = 60.0  # once the injected script runs: imports and the agent's start, on a loaded host
# System call classes (native.syscalls) in which a thread waits idle, holding no libc lock: the
# injected dlopen can run on such a thread. Best first.
_IDLE_CLASSES = ("poll", "sleep", "lock")


def injection_thread(pid: int) -> int:
    """The thread of ``pid`` that pyinjector should run the injected ``dlopen`` on.

    pyinjector stops a thread with ptrace and runs ``dlopen`` on it. Stopped while it held a libc
    lock (malloc's, the loader's), that thread waits for its own lock forever, and the job with
    it: a job deadlocked so about once in 6 attaches (stop 21's note), and an attach test failed
    so in CI. A thread blocked in a waiting system call (poll, sleep, a futex: the idle pool
    threads, the threads waiting for the GIL) holds none; the main thread (``pid``) when the
    target has no such thread."""
    from aiprof.native.syscalls import parse_syscall_line, syscall_class, syscall_name

    best: tuple[int, int] | None = None
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return pid
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                got = parse_syscall_line(f.read())
        except OSError:
            continue
        if got is None:
            continue
        cls = syscall_class(syscall_name(got[0]))
        if cls in _IDLE_CLASSES:
            rank = _IDLE_CLASSES.index(cls)
            if best is None or rank < best[0]:
                best = (rank, tid)
    return best[1] if best else pid


def _inject_pyinjector(info: ProcessInfo, so: str) -> None:
    # in a child process, so that a stuck injection cannot hang the CLI
    code = "import sys, pyinjector; pyinjector.inject(int(sys.argv[1]), sys.argv[2])"
    try:
        r = subprocess.run([sys.executable, "-c", code, str(injection_thread(info.pid)), so], capture_output=True,
                           text=True, timeout=INJECT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AttachError(f"{info.label}: library injection did not finish within {INJECT_TIMEOUT_S:.0f} s "
                          "(the target may be stuck in the dynamic loader)") from None
    if r.returncode != 0:
        err = (r.stderr or "").strip().splitlines()
        msg = next((ln for ln in reversed(err) if "Error" in ln or "Exception" in ln), err[-1] if err else "failed")
        if "permission" in msg.lower() or "-8" in msg or "EPERM" in msg:
            check_ptrace_allowed(info)
            raise AttachError(f"{info.label}: ptrace was refused (EPERM): needs CAP_SYS_PTRACE, or the "
                              "container/seccomp forbids ptrace (docker: --cap-add SYS_PTRACE)")
        raise AttachError(f"{info.label}: library injection failed: {msg}")


_FRIDA_LOAD = """
import sys, frida
s = frida.attach(int(sys.argv[1]))
sc = s.create_script("try { Module.load(%s); send('ok'); } catch (e) { send('error: ' + e); }" % repr(sys.argv[2]))
got = []
sc.on("message", lambda m, d: got.append(m.get("payload", m.get("description"))))
sc.load()
sc.unload()
s.detach()
print(got[0] if got else "error: no answer")
sys.exit(0 if got and got[0] == "ok" else 1)
"""


def _inject_frida(info: ProcessInfo, so: str) -> None:
    # Frida's Module.load is a dlopen from a thread Frida injects (ptrace only while it does so);
    # in a child process, so that a stuck injection cannot hang the CLI
    try:
        r = subprocess.run([sys.executable, "-c", _FRIDA_LOAD, str(info.pid), so], capture_output=True, text=True,
                           timeout=INJECT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AttachError(f"{info.label}: library injection (Frida) did not finish within {INJECT_TIMEOUT_S:.0f} s") from None
    if r.returncode != 0:
        lines = ((r.stdout or "") + (r.stderr or "")).strip().splitlines()
        msg = lines[-1] if lines else "failed"
        if "permission" in msg.lower() or "ptrace" in msg.lower():
            check_ptrace_allowed(info)
        raise AttachError(f"{info.label}: library injection (Frida) failed: {msg}")


def _inject_gdb(info: ProcessInfo, so: str, gdb: str) -> None:
    r = subprocess.run([gdb, "-p", str(info.pid), "-batch", "-nx", "-ex", f'call (void*)dlopen("{so}", 2)'],
                       capture_output=True, text=True, timeout=60)
    out = (r.stdout + r.stderr)
    if "ptrace: Operation not permitted" in out:
        check_ptrace_allowed(info)
        raise AttachError(f"{info.label}: ptrace was refused: needs CAP_SYS_PTRACE (or ptrace_scope/seccomp forbid it)")
    if r.returncode != 0 or "$1 = (void *) 0x0" in out:
        raise AttachError(f"{info.label}: gdb could not load the shim: {out.strip().splitlines()[-1:]}")


def available_methods(version: tuple[int, int] | None) -> list[str]:
    """Injection methods usable here for a target of this Python version, best first."""
    out = []
    if version is not None and version >= (3, 14):
        out.append("remote_exec")
    try:
        import pyinjector  # noqa: F401  # type: ignore[import-not-found]

        out.append("pyinjector")
    except Exception:
        pass
    from aiprof.native.engine import frida_status

    if frida_status()[0]:
        out.append("frida")
    if shutil.which("gdb"):
        out.append("gdb")
    return out


def inject_agent(info: ProcessInfo, rt: str, agent_rt: str | None = None, entry: str | None = None,
                 timeout: float = 15.0, method: str | None = None, server: dict | None = None) -> InjectResult:
    """Load and start the agent in ``info.pid``; waits (bounded) for its status file.

    ``rt``: our runtime folder (staging); ``agent_rt``: where the agent puts its control socket.
    """
    methods = available_methods(info.version)
    if method:
        if method not in methods:
            raise AttachError(f"injection method {method!r} is not available here (have: {', '.join(methods) or 'none'})")
        methods = [method]
    if not methods:
        raise AttachError("no injection method available: pip install pyinjector (or install gdb)")
    so, py, status_path = _stage(info, rt, agent_rt or rt, entry, server)
    m = methods[0]
    started = False
    try:
        if m != "remote_exec" and not wait_until_not_importing(info.pid):
            raise AttachError(f"{info.label} has been importing modules for 30 s; attach when it is running")
        if m == "remote_exec":
            _inject_remote_exec(info, py)
        elif m == "pyinjector":
            _inject_pyinjector(info, so)
        elif m == "frida":
            _inject_frida(info, so)
        else:
            _inject_gdb(info, so, shutil.which("gdb") or "gdb")
        deadline = time.monotonic() + timeout
        begun_path = status_path + ".begun"
        begun = False
        while time.monotonic() < deadline:
            if os.path.exists(status_path):
                started = True
                with open(status_path) as f:
                    status = json.load(f)
                if not status.get("ok"):
                    raise AttachError(f"{info.label}: {status.get('error')}")
                return InjectResult(info.pid, m, status)
            if not os.path.exists(f"/proc/{info.pid}"):
                raise AttachError(f"{info.label} exited during attach")
            if not begun and os.path.exists(begun_path):
                # the script runs: what is left is the agent's imports and start, which take
                # longer than `timeout` on a loaded host (an attach test failed so in CI)
                begun = True
                deadline = max(deadline, time.monotonic() + AGENT_START_TIMEOUT_S)
            time.sleep(0.05)
        if begun:
            started = True
            raise AttachError(f"{info.label}: the agent began to start but did not finish within "
                              f"{AGENT_START_TIMEOUT_S:.0f} s (a loaded host, or torch still importing?)")
        raise AttachError(f"{info.label}: the agent did not start within {timeout:.0f} s: its main thread ran no "
                          "Python code (blocked in a C call or sleeping?)")
    except AttachError:
        started = started or not os.path.exists(f"/proc/{info.pid}")
        raise
    finally:
        # a script not yet run stays: the pending call may still run it later
        for p in ((so, py, status_path, status_path + ".begun") if started else (so,)):
            try:
                os.unlink(p)
            except OSError:
                pass
        if started:
            try:
                os.rmdir(os.path.dirname(py))
            except OSError:
                pass
