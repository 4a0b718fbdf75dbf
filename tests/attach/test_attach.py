"""`aiprof attach` and `aiprof stacks` against real processes started without aiprof (CPU torch)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from capsupport import (PY, REPO, SCRIPTS, TINY, aiprof, categories, load_meta, load_trace,
                        profiler_steps, stop, torch_loaded, wait_for)

from aiprof.attach.procs import AttachError, ProcessInfo, check_attachable


def _plain_env() -> dict[str, str]:
    """A target's environment: nothing of aiprof (no PYTHONPATH, no agent settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIPROF") and k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_plain_env())


def _injection_problem() -> str | None:
    """None if library injection works on this machine, else the precise reason it does not."""
    from aiprof.attach.inject import available_methods, build_shim

    methods = available_methods((3, 11))
    if not methods:
        return "no injection method: neither pyinjector nor gdb is installed"
    try:
        build_shim()
    except AttachError as exc:
        return str(exc)
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if scope.exists() and scope.read_text().strip() == "3":
        return "kernel.yama.ptrace_scope=3: ptrace disabled on this host"
    probe = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"], env=_plain_env())
    try:
        time.sleep(0.3)
        if "pyinjector" in methods:
            import pyinjector

            so = build_shim()
            tmp = Path(__import__("tempfile").mkdtemp(prefix="aip-probe-"))
            shutil.copy(so, tmp / "p.so")
            (tmp / "p.py").write_text(f"open({str(tmp / 'ok')!r}, 'w').write('1')\n")
            try:
                pyinjector.inject(probe.pid, str(tmp / "p.so"))
            except Exception as exc:  # e.g. seccomp forbids ptrace in this container
                return f"pyinjector cannot inject here: {str(exc).splitlines()[0]}"
            try:
                wait_for(lambda: (tmp / "ok").exists(), 10, "the probe's injected script")
            except AssertionError as exc:
                return f"injected library did not run its script: {exc}"
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return None
    finally:
        probe.kill()
        probe.wait()


@pytest.fixture(scope="module")
def injection_ok():
    why = _injection_problem()
    if why:
        pytest.skip(f"attach cannot work on this machine: {why}")


@pytest.fixture
def tiny_target(tmp_path):
    """tiny_train.py running forever under a unique name, started without aiprof; torch loaded."""
    name = f"aiprof_target_{secrets.token_hex(3)}.py"
    script = tmp_path / name
    shutil.copy(TINY, script)
    proc = _spawn([PY, str(script), "--steps", "0"])
    try:
        wait_for(lambda: torch_loaded(proc.pid) or proc.poll() is not None, 60, "torch import in the target")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        time.sleep(0.5)  # let it reach the training loop
        yield proc, name
    finally:
        stop(proc)


def test_attach_captures_and_trigger_reuses_agent(injection_ok, tiny_target, rt, tmp_path):
    proc, name = tiny_target
    out = tmp_path / "caps"
    res = aiprof(rt, "attach", str(proc.pid), "--iterations", "3", "--what", "kernels,python,hw", "--out", str(out),
                 "--capture-id", "a1", "--json")
    assert res.returncode == 0, res.stderr
    assert "agent started via" in res.stderr
    r = json.loads(res.stdout)["results"][str(proc.pid)]
    assert r["ok"], r
    d = Path(r["dir"])
    assert d == out / "a1" / "rank0"
    trace = load_trace(d)
    steps = profiler_steps(trace)
    assert len(steps) == 3 and steps == r["steps"] == list(range(steps[0], steps[0] + 3))
    assert {"cpu_op", "python_function"} <= categories(trace)
    meta = load_meta(d)
    assert meta["origin"] == "attach" and meta["pid"] == proc.pid and meta["steps"]["source"] == "optimizer"
    assert (d / "hw.csv").exists()
    # the job keeps training after the capture
    assert proc.poll() is None
    # attach by NAME finds the same process; its agent is reused
    res2 = aiprof(rt, "attach", name, "--no-capture")
    assert res2.returncode == 0 and "agent already running" in res2.stderr, res2.stderr
    res3 = aiprof(rt, "trigger", "--pid", str(proc.pid), "-n", "1", "--out", str(out), "--capture-id", "a2")
    assert res3.returncode == 0, res3.stdout + res3.stderr
    assert len(profiler_steps(load_trace(out / "a2" / "rank0"))) == 1
    if (REPO / "src" / "aiprof" / "cli" / "analyze.py").exists():
        an = aiprof(rt, "analyze", str(out / "a1"), "--json", "--out", str(tmp_path / "rep"))
        assert an.returncode == 0, an.stderr
        assert [s["step"] for s in json.loads(an.stdout)["ranks"][0]["steps"]] == steps


def test_attach_entry_function(injection_ok, rt, tmp_path):
    """attach --entry wraps a function of the running script (no optimizer in it)."""
    proc = _spawn([PY, str(SCRIPTS / "infer_loop.py"), "--sleep-ms", "5"])
    try:
        wait_for(lambda: torch_loaded(proc.pid), 60, "torch import in the target")
        time.sleep(0.3)
        out = tmp_path / "caps"
        res = aiprof(rt, "attach", str(proc.pid), "--entry", "__main__:serve_step", "-n", "2", "--out", str(out),
                     "--capture-id", "e1", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        meta = load_meta(out / "e1" / "rank0")
        assert meta["steps"]["source"] == "entry:__main__:serve_step" and meta["mode"] == "iterations"
        assert len(profiler_steps(load_trace(out / "e1" / "rank0"))) == 2
    finally:
        stop(proc)


def test_attach_without_iterations_falls_back_to_duration(injection_ok, rt, tmp_path):
    proc = _spawn([PY, str(SCRIPTS / "infer_loop.py"), "--sleep-ms", "5"])
    try:
        wait_for(lambda: torch_loaded(proc.pid), 60, "torch import in the target")
        out = tmp_path / "caps"
        res = aiprof(rt, "attach", str(proc.pid), "--wait-ms", "300", "--duration-ms", "300", "--out", str(out),
                     "--capture-id", "w1", "--json", "--timeout", "40")
        assert res.returncode == 0, res.stdout + res.stderr
        meta = load_meta(out / "w1" / "rank0")
        assert meta["mode"] == "time" and meta["recorded_s"] >= 0.3
    finally:
        stop(proc)


def test_stacks_text_and_json(tiny_target, rt):
    proc, _ = tiny_target
    res = aiprof(rt, "stacks", str(proc.pid), "--json")
    assert res.returncode == 0, res.stderr
    (d,) = json.loads(res.stdout)
    assert d["pid"] == proc.pid and d["ok"]
    main = [t for t in d["threads"] if t["os_thread_id"] == proc.pid]
    assert main and main[0]["frames"]
    funcs = {f["function"] for t in d["threads"] for f in t["frames"]}
    assert "main" in funcs or "<module>" in funcs
    assert all({"function", "file", "line", "native"} <= set(f) for t in d["threads"] for f in t["frames"])
    txt = aiprof(rt, "stacks", str(proc.pid), "--native")
    assert txt.returncode == 0 and f"pid {proc.pid}:" in txt.stdout and "thread" in txt.stdout
    from aiprof.attach.stacks import dump_stacks  # the library call the hang analysis uses

    (lib,) = dump_stacks([proc.pid])
    assert lib["ok"] and lib["threads"]


# -- error cases: one line on stderr, exit code 2 ----------------------------------------------


def _one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiprof: error:"), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _free_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_attach_errors(rt):
    _one_line_error(aiprof(rt, "attach", str(_free_pid())), "no such process")
    _one_line_error(aiprof(rt, "attach", "no-such-python-anywhere-42"), "no running Python process matches")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        _one_line_error(aiprof(rt, "attach", str(sleeper.pid)), "is not a CPython process")
    finally:
        sleeper.kill()
        sleeper.wait()
    no_torch = _spawn([PY, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        time.sleep(0.3)
        _one_line_error(aiprof(rt, "attach", str(no_torch.pid)), "torch is not imported")
    finally:
        stop(no_torch)
    _one_line_error(aiprof(rt, "stacks", str(_free_pid())), "no such process")


def test_old_python_is_refused():
    # no Python < 3.10 exists here to start; the version gate is checked on its own
    info = ProcessInfo(pid=os.getpid(), comm="python3.9", cmdline=["python3.9"], exe="/usr/bin/python3.9", uid=os.geteuid(),
                       ppid=1, is_python=True, version=(3, 9), torch_loaded=True)
    with pytest.raises(AttachError, match="Python 3.9; attach supports 3.10 or newer"):
        check_attachable(info)


def test_no_permission_names_the_capability(tmp_path):
    """An unprivileged user attaching to root's process is told which permission is missing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process of another user")
    py = "/usr/bin/python3"
    if not os.access(py, os.X_OK):
        pytest.skip(f"{py} missing: no interpreter that uid 65534 can run (the venv lives under /root)")
    target = _spawn([PY, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        code = ("import sys; sys.path.insert(0, %r)\n"
                "from aiprof.attach.procs import inspect_process, check_attachable, AttachError\n"
                "try:\n    check_attachable(inspect_process(%d))\nexcept AttachError as e:\n    print(e)\n")
        res = subprocess.run([py, "-c", code % (str(REPO / "src"), target.pid)], capture_output=True, text=True,
                             timeout=30, user=65534, group=65534, extra_groups=[], cwd="/")
        if res.returncode != 0 and "Permission denied" in res.stderr:
            pytest.skip(f"uid 65534 cannot read the source tree: {res.stderr.strip().splitlines()[-1]}")
        assert res.returncode == 0, res.stderr
        assert "no permission" in res.stdout and "CAP_SYS_PTRACE" in res.stdout and "uid 0" in res.stdout
    finally:
        stop(target)


def test_injection_goes_to_a_thread_waiting_in_a_system_call():
    """pyinjector's dlopen runs on the thread it stops: a thread blocked in a sleep holds no libc
    lock, the busy main thread may (inject.injection_thread). A real process of each kind."""
    import subprocess
    import sys

    from aiprof.attach.inject import injection_thread

    busy = "import sys\nprint('ready', flush=True)\nwhile True: pass\n"
    sleeper = ("import threading, time, sys\nthreading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
               "time.sleep(0.2)\nprint('ready', flush=True)\nwhile True: pass\n")
    for code, want_other in ((busy, False), (sleeper, True)):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            tid = injection_thread(p.pid)
            if want_other:
                assert tid != p.pid
                with open(f"/proc/{p.pid}/task/{tid}/syscall") as f:
                    assert f.read().split()[0] not in ("running", "-1")
            else:
                assert tid == p.pid
        finally:
            p.kill()
            p.wait(10)
