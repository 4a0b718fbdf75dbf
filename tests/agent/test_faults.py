"""The job is never hurt: faults around a capture, with real processes (aiprof run + the CPU
example's model and step). Whatever goes wrong, the job runs every step and exits as it would
without the agent; the agent says what failed in one line and leaves no half-written capture.
The scripts print each step and hold at gates the tests open, so nothing here depends on timing."""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
from pathlib import Path

import pytest
from capsupport import PY, SCRIPTS, env_with, load_meta, load_trace, profiler_steps, rank_dirs, wait_for

from aiprof.agent.capture import OFFSTOP_ENV
from aiprof.agent.traceout import FORK_ENV, choose_fork

GATED = SCRIPTS / "gated_train.py"


def _run(rt: str, out: Path, *job: str, capture: tuple[str, ...] = ("--skip", "2", "--iterations", "2"),
         preexec=None, timeout: float = 180, fork: str = "auto") -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "aiprof", "run", *capture, "--out", str(out), "--capture-id", "c", "--",
                           PY, str(GATED), *job], capture_output=True, text=True, timeout=timeout,
                          env=env_with(rt, **{FORK_ENV: fork}), preexec_fn=preexec, check=False)


def _steps(stdout: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+) [0-9.]+ ms$", stdout, re.M)]


def _job_finished(res: subprocess.CompletedProcess, steps: int) -> None:
    """Exit code 0, every step run once in order, the end reached, no traceback anywhere."""
    assert res.returncode == 0, res.stderr[-3000:]
    assert _steps(res.stdout) == list(range(steps)) and f"done {steps} steps" in res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


def _agent_state(rt: str, pid: int) -> str | None:
    res = subprocess.run([PY, "-m", "aiprof", "trigger", "--list", "--json", "--pid", str(pid)], capture_output=True,
                         text=True, timeout=60, env=env_with(rt), check=False)
    try:
        return json.loads(res.stdout)[0]["state"]
    except (ValueError, IndexError, KeyError):
        return None


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (made by any of its threads)."""
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _agent_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("aiprof agent[")]


def test_output_folder_not_writable(rt, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through modes: make the folder immutable instead
        if subprocess.run(["chattr", "+i", str(ro)], capture_output=True, check=False).returncode != 0:
            pytest.skip("running as root without chattr: no folder here is unwritable")
    else:
        ro.chmod(0o500)
    try:
        res = _run(rt, ro / "caps", "--steps", "8")
        _job_finished(res, 8)
        (line,) = [ln for ln in _agent_lines(res.stderr) if "capture failed" in ln]
        assert "export failed" in line and ("Permission" in line or "not permitted" in line), line
        assert not (ro / "caps").exists()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], check=False)
        ro.chmod(0o700)


@pytest.mark.parametrize("fork", ["0", "1"], ids=["thread", "fork"])
def test_disk_full_while_writing_the_trace(rt, tmp_path, fork):
    """A 256 KiB file size limit (what a full disk looks like to the writer: the trace of a few
    steps is megabytes): Kineto's writer stops silently; the agent notices, keeps nothing."""
    limit = 256 << 10

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "caps"
    res = _run(rt, out, "--steps", "8", capture=("--skip", "2", "--iterations", "3", "--what", "kernels,python"),
               preexec=small_files, fork=fork)
    _job_finished(res, 8)
    (line,) = [ln for ln in _agent_lines(res.stderr) if "capture failed" in ln]
    assert "could not write the whole trace JSON (disk full or a file size limit?)" in line, line
    left = [p.name for p in (out / "c" / "rank0").iterdir()] if (out / "c" / "rank0").exists() else []
    assert left == [], left  # no half-written trace, no meta.json claiming a capture


@pytest.mark.parametrize("order", ["job-first", "agent-first"])
def test_capture_request_during_the_jobs_own_profiler(rt, tmp_path, order):
    """Two profiler sessions in one process corrupt the job's trace (events twice) or crash it
    at its own stop; the agent stays out of the way whichever comes first."""
    own = tmp_path / "own.json"
    capture = ("--skip", "4", "--iterations", "2") if order == "job-first" else ("--skip", "0", "--iterations", "6")
    res = _run(rt, tmp_path / "caps", "--steps", "12", "--own-profiler", "2:9", "--own-trace", str(own),
               capture=capture)
    _job_finished(res, 12)
    (line,) = [ln for ln in _agent_lines(res.stderr) if "capture failed" in ln]
    assert "own torch.profiler" in line, line
    assert "disableProfiler called but no active profiling session" not in res.stderr
    marks = [e["name"] for e in json.loads(own.read_text())["traceEvents"]
             if str(e.get("name", "")).startswith("job_step_") and e.get("ph") == "X"]
    assert sorted(marks, key=lambda n: int(n.rsplit("_", 1)[1])) == [f"job_step_{k}" for k in range(2, 9)]
    assert rank_dirs(tmp_path / "caps") == []


def test_sigterm_during_a_capture_ends_the_job_as_without_the_agent(rt, tmp_path):
    """No handler in the job: SIGTERM ends it at once, with or without the agent (143 = 128 +
    SIGTERM from the launcher); no capture claims to be complete."""
    out = tmp_path / "caps"
    gate = tmp_path / "gate-never-opened"
    waiting = Path(f"{gate}.waiting")
    job = [PY, str(GATED), "--steps", "20", "--gate", f"6:{gate}"]
    plain = subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(rt))
    try:
        wait_for(waiting.exists, 60, "the plain job held before step 6")
        plain.send_signal(signal.SIGTERM)
        p_out, _ = plain.communicate(timeout=60)
    finally:
        if plain.poll() is None:
            plain.kill()
    waiting.unlink()
    run = subprocess.Popen([PY, "-m", "aiprof", "run", "--skip", "3", "--iterations", "10", "--out", str(out),
                            "--capture-id", "c", "--", *job], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env_with(rt))
    try:
        wait_for(waiting.exists, 60, "the job under the agent held before step 6 (recording since step 3)")
        run.send_signal(signal.SIGTERM)  # aiprof run forwards it to the job
        r_out, r_err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert plain.returncode == -signal.SIGTERM and run.returncode == 128 + signal.SIGTERM, r_err[-2000:]
    assert _steps(r_out) == _steps(p_out) == list(range(6))
    assert "Traceback" not in r_err and rank_dirs(out) == []


@pytest.mark.parametrize("fork,offstop", [("0", "0"), ("1", "0"), ("auto", "1")], ids=["thread", "fork", "offthread"])
def test_sigterm_with_the_jobs_own_handler_keeps_the_capture(rt, tmp_path, fork, offstop):
    """A job that ends cleanly on SIGTERM exits 0 as without the agent; the agent stops its
    capture at exit and writes it whole, noting why it is short."""
    out = tmp_path / "caps"
    gate = tmp_path / "gate-never-opened"
    run = subprocess.Popen([PY, "-m", "aiprof", "run", "--skip", "3", "--iterations", "10", "--out", str(out),
                            "--capture-id", "c", "--", PY, str(GATED), "--steps", "20", "--graceful-sigterm",
                            "--gate", f"6:{gate}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env_with(rt, **{FORK_ENV: fork, OFFSTOP_ENV: offstop}))
    try:
        wait_for(Path(f"{gate}.waiting").exists, 60, "the job held before step 6")
        run.send_signal(signal.SIGTERM)
        r_out, r_err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0 and "stopped by SIGTERM before step 6" in r_out, r_err[-2000:]
    assert _steps(r_out) == list(range(6)) and "Traceback" not in r_err
    (d,) = rank_dirs(out, "c")
    meta = load_meta(d)
    # iterations 3-5 ran whole; 6 had begun (the boundary is the optimizer step) when SIGTERM came
    assert meta["steps"]["captured"] == [3, 4, 5, 6] and "the job exited during the capture" in meta["errors"]
    assert profiler_steps(load_trace(d)) == [3, 4, 5, 6]
    assert meta["stop"]["how"] == ("detached" if offstop == "1" else "stop_trace"), meta["stop"]


def test_the_trace_is_written_by_a_child_process_while_the_job_runs_on(rt, tmp_path):
    """The structure of the flush, without timing: the trace is written by a child of the job
    (here held at the opening of trace.json.gz, a FIFO the test reads only when it wants), while
    the job goes on stepping; the file arrives whole afterwards and meta.json only after it."""
    out = tmp_path / "caps"
    rank = out / "c" / "rank0"
    rank.mkdir(parents=True)
    fifo = rank / "trace.json.gz"
    os.mkfifo(fifo)
    gate = tmp_path / "gate"
    run = subprocess.Popen([PY, "-m", "aiprof", "run", "--skip", "2", "--iterations", "2", "--out", str(out),
                            "--capture-id", "c", "--", PY, str(GATED), "--steps", "12", "--gate", f"9:{gate}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env_with(rt, **{FORK_ENV: "1", OFFSTOP_ENV: "0"}))
    try:
        waiting = Path(f"{gate}.waiting")
        wait_for(waiting.exists, 90, "the job held before step 9, five steps after the capture stopped")
        job_pid = int(waiting.read_text())
        # the writer blocks at the FIFO until the test reads it, so waiting for it cannot race
        writers = wait_for(lambda: _children(job_pid), 60, "a child process of the job writing the trace")
        assert not (rank / "meta.json").exists()  # the capture is not complete yet
        with open(fifo, "rb") as f:  # let the writer go: what it streams is the whole trace
            data = f.read()
        gate.write_text("")
        r_out, r_err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, r_err[-2000:]
    assert _steps(r_out) == list(range(12))
    (tmp_path / "trace.json.gz").write_bytes(data)
    trace = load_trace(tmp_path)
    assert profiler_steps(trace) == [2, 3]
    meta = load_meta(rank)
    assert meta["export"]["how"] == "fork" and meta["export"]["pid"] in writers and meta["export"]["fork_ms"] > 0
    assert meta["export"]["pid"] != meta["pid"] and meta["trace_json_bytes"] > 0


def test_the_agent_survives_the_trace_writer_dying(rt, tmp_path):
    """The child that writes the trace is killed: the capture fails with that reason, the job
    finishes, and the next capture of the same process works."""
    out = tmp_path / "caps"
    rank = out / "c" / "rank0"
    rank.mkdir(parents=True)
    os.mkfifo(rank / "trace.json.gz")  # holds the writer until the test kills it
    gate, gate2 = tmp_path / "gate", tmp_path / "gate2"
    run = subprocess.Popen([PY, "-m", "aiprof", "run", "--skip", "2", "--iterations", "2", "--out", str(out),
                            "--capture-id", "c", "--", PY, str(GATED), "--steps", "80", "--gate", f"7:{gate}",
                            "--gate", f"75:{gate2}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env_with(rt, **{FORK_ENV: "1", OFFSTOP_ENV: "0"}))
    try:
        wait_for(Path(f"{gate}.waiting").exists, 90, "the job held before step 7")
        job_pid = int(Path(f"{gate}.waiting").read_text())
        writers = wait_for(lambda: _children(job_pid), 60, "the child process writing the trace")
        assert len(writers) == 1
        os.kill(writers[0], signal.SIGKILL)
        # the agent notices (its export thread reaps the child), reports, and is idle again
        wait_for(lambda: _agent_state(rt, job_pid) == "idle", 60, "the agent idle after the writer's death")
        # the same process takes the next capture (local trigger) and writes it whole
        trig = subprocess.Popen([PY, "-m", "aiprof", "trigger", "--pid", str(job_pid), "--iterations", "2",
                                 "--wait-ms", "600000", "--out", str(out), "--capture-id", "c2", "--timeout", "90"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(rt))
        wait_for(lambda: _agent_state(rt, job_pid) == "armed", 60, "the second capture armed")
        gate.write_text("")  # the trigger starts within 50 iterations (its alignment margin), before step 75
        t_out, t_err = trig.communicate(timeout=120)
        gate2.write_text("")
        r_out, r_err = run.communicate(timeout=120)
    finally:
        for p in (run, trig) if "trig" in locals() else (run,):
            if p.poll() is None:
                p.kill()
    assert run.returncode == 0 and _steps(r_out) == list(range(80)), r_err[-2000:]
    (line,) = [ln for ln in _agent_lines(r_err) if "capture failed" in ln]
    assert "killed by signal 9" in line, line
    assert not (rank / "meta.json").exists()
    assert trig.returncode == 0, t_out + t_err
    (d,) = rank_dirs(out, "c2")
    assert len(profiler_steps(load_trace(d))) == 2


def test_the_writer_is_chosen_by_the_size_of_the_trace():
    """auto: fork only for a trace whose stop_trace took long (the save costs about as much)."""
    assert choose_fork(1e9, "0") == (False, f"{FORK_ENV}=0")
    assert choose_fork(0.0, "1") == (True, f"{FORK_ENV}=1")
    small, why = choose_fork(2.0, "auto")
    assert not small and ("small trace" in why or "CPUs" in why)
    big, why = choose_fork(1e9, "auto")  # a stop of 1e6 s: any fork is cheaper, given a core to spare
    assert big == (len(os.sched_getaffinity(0)) >= 2), why
