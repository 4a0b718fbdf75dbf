"""`aiprof run`: preload, iteration/duration/entry captures, trigger, exit codes — real torch on CPU."""
from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

from capsupport import (PY, REPO, SCRIPTS, TINY, aiprof, categories, env_with, load_meta, load_trace,
                        profiler_steps, rank_dirs, stop, wait_for)

HAVE_ANALYZE = (REPO / "src" / "aiprof" / "cli" / "analyze.py").exists()


def test_run_skip_then_iterations(rt, tmp_path):
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--skip", "3", "--iterations", "2", "--what", "kernels,python,hw", "--out", str(out),
                 "--capture-id", "c1", "--", PY, str(TINY), "--steps", "12")
    assert res.returncode == 0, res.stderr
    (d,) = rank_dirs(out, "c1")
    assert d.name == "rank0"
    trace = load_trace(d)
    assert profiler_steps(trace) == [3, 4]  # iterations 0-2 skipped, then 2 recorded
    assert {"cpu_op", "python_function", "user_annotation"} <= categories(trace)
    meta = load_meta(d)
    assert meta["schema"] == "aiprof.capture/1"
    assert (meta["rank"], meta["world_size"], meta["pid"] > 0) == (0, 1, True)
    assert meta["steps"]["captured"] == [3, 4] and meta["steps"]["source"] == "optimizer"
    assert meta["mode"] == "iterations" and meta["origin"] == "run"
    # the unprofiled iterations: those timed before the profiler is prepared (one boundary ahead of
    # the start, for CUPTI's warm-up): of the intervals between the boundaries seen before the
    # capture's, the one holding the preparation is left out, one is left
    assert len(meta["steps"]["before_ms"]) == 1 and meta["steps"]["before_median_ms"] > 0
    assert meta["cmdline"][-3:] == [str(TINY), "--steps", "12"]
    assert meta["versions"]["torch"] and meta["options"]["what"] == ["kernels", "python", "hw"]
    # clock: Kineto ts are µs since baseTimeNanoseconds (a Unix time); the marker's bracket holds
    # it, so the offset is the base's
    off = meta["clock"]["trace_minus_unix_us"]
    assert off == -trace["baseTimeNanoseconds"] / 1000 and "baseTimeNanoseconds" in meta["clock"]["method"], \
        meta["clock"]
    # hardware: no GPU here, host samples still written, on the trace clock
    rows = list(csv.DictReader(open(d / "hw.csv")))
    assert {"cpu_util_pct", "proc_cpu_pct", "mem_used_bytes", "proc_rss_bytes"} <= {r["metric"] for r in rows}
    assert "psutil" in meta["hw"]["sources"] and "nvml" not in meta["hw"]["sources"]
    t0 = (meta["started_unix_ns"] / 1000 + off) - 5e6
    assert all(abs(float(r["ts_us"]) - t0) < 3e7 for r in rows)  # within seconds of the capture
    assert "capture c1" in res.stderr
    if HAVE_ANALYZE:
        an = aiprof(rt, "analyze", str(out / "c1"), "--json", "--out", str(tmp_path / "report"))
        assert an.returncode == 0, an.stderr
        rep = json.loads(an.stdout)
        assert [s["step"] for s in rep["ranks"][0]["steps"]] == [3, 4]


def test_run_torchrun_every_rank_measures_the_unprofiled_step(rt, tmp_path):
    """A 2-rank gloo DDP job under torchrun: each rank's agent times the iterations before its
    capture (what the diagnosis fits its replay to, issue 28 item 7), and the report says which
    ranks had it."""
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--skip", "10", "--iterations", "3", "--what", "kernels,python", "--out", str(out),
                 "--capture-id", "ddp", "--", PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(REPO / "tests" / "server" / "scripts" / "gloo_train.py"), "--seconds", "6")
    assert res.returncode == 0, res.stderr
    dirs = rank_dirs(out, "ddp")
    assert [d.name for d in dirs] == ["rank0", "rank1"]
    for r, d in enumerate(dirs):
        meta = load_meta(d)
        assert (meta["rank"], meta["world_size"], meta["steps"]["captured"]) == (r, 2, [10, 11, 12])
        # --skip 10: 9 intervals between boundaries before the capture's, the last holding the
        # profiler's preparation, left out
        assert len(meta["steps"]["before_ms"]) == 8 and meta["steps"]["before_median_ms"] > 0
    if HAVE_ANALYZE:
        an = aiprof(rt, "analyze", str(out / "ddp"), "--json")
        assert an.returncode == 0, an.stderr
        rows = json.loads(an.stdout)["baseline"]
        assert [(b["rank"], b["priced_from"], b["unprofiled_step_us"] > 0) for b in rows] == \
            [(0, "job unprofiled", True), (1, "job unprofiled", True)]
        txt = aiprof(rt, "analyze", str(out / "ddp"), env=env_with(rt, COLUMNS="400"))
        assert "unprofiled step measured by the agent on ranks 0, 1 (" in txt.stdout


def test_run_duration_with_iterations(rt, tmp_path):
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--skip", "2", "--duration-ms", "60", "--what", "kernels", "--out", str(out),
                 "--capture-id", "d1", "--", PY, str(TINY), "--steps", "60")
    assert res.returncode == 0, res.stderr
    (d,) = rank_dirs(out, "d1")
    meta = load_meta(d)
    assert meta["mode"] == "duration"
    steps = profiler_steps(load_trace(d))
    assert steps and steps[0] == 2 and steps == meta["steps"]["captured"]
    assert steps == list(range(2, 2 + len(steps)))
    assert meta["recorded_s"] >= 0.06


def test_run_time_based_without_iterations(rt, tmp_path):
    """No optimizer, no entry: after --wait-ms the capture runs D ms on the main thread."""
    out = tmp_path / "caps"
    # the first profiler start in a process initialises Kineto (~1 s on a loaded 2-core box)
    res = aiprof(rt, "run", "--duration-ms", "400", "--wait-ms", "200", "--out", str(out), "--capture-id", "t1",
                 "--", PY, str(SCRIPTS / "infer_loop.py"), "--seconds", "6")
    assert res.returncode == 0, res.stderr
    (d,) = rank_dirs(out, "t1")
    meta = load_meta(d)
    assert meta["mode"] == "time" and meta["thread"] == "MainThread"
    assert 0.35 <= meta["recorded_s"] < 3 and not meta["errors"]
    trace = load_trace(d)
    assert profiler_steps(trace) == []
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::linear" in names or "aten::addmm" in names


def test_run_entry_function(rt, tmp_path):
    """--entry __main__:serve_step: each call of the user's function is one iteration."""
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--entry", "__main__:serve_step", "--skip", "2", "--iterations", "3", "--out", str(out),
                 "--capture-id", "e1", "--", PY, str(SCRIPTS / "infer_loop.py"), "--calls", "40", "--sleep-ms", "20")
    assert res.returncode == 0, res.stderr
    (d,) = rank_dirs(out, "e1")
    meta = load_meta(d)
    assert meta["steps"]["source"] == "entry:__main__:serve_step"
    steps = profiler_steps(load_trace(d))
    assert len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3))
    # wrapped by the control thread shortly after definition: at most a few early calls missed
    assert steps[0] >= 2


def test_run_exit_code_and_no_torch_is_untouched(rt, tmp_path):
    """The child's exit code comes back; a process that never imports torch gets no agent."""
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    env = env_with(rt)
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    code = ("import os, sys; print(os.environ.get('USER_SITECUSTOMIZE_RAN'), sys.path.count(%r) == 1, "
            "'aiprof.agent.bootstrap' in sys.modules); sys.exit(7)" % str(site))
    res = subprocess.run([PY, "-m", "aiprof", "run", "--", PY, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 7, res.stderr
    assert res.stdout.split() == ["1", "True", "False"]  # user's sitecustomize ran, PYTHONPATH kept, no agent
    assert not list(Path(rt).glob("agent-*.sock"))


def test_run_bad_usage(rt):
    res = aiprof(rt, "run", "--iterations", "0", "--", PY, "-c", "pass")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "--iterations" in res.stderr
    res = aiprof(rt, "run", "--what", "kernels,bogus", "--", PY, "-c", "pass")
    assert res.returncode == 2 and "bogus" in res.stderr
    res = aiprof(rt, "run", "--", "/nonexistent/cmd")
    assert res.returncode == 2 and "command not found" in res.stderr


def test_agent_errors_never_reach_the_job(rt, tmp_path):
    """An unwritable output folder: the capture fails, the job finishes normally, one stderr line."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = aiprof(rt, "run", "--skip", "1", "--iterations", "1", "--out", str(blocker / "sub"),
                 "--", PY, str(TINY), "--steps", "8")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("aiprof agent[")]
    assert lines and "export failed" in lines[0] and "Traceback" not in res.stderr
    # a broken AIPROF_AGENT setting is reported once and ignored
    env = env_with(rt, AIPROF_AGENT="{not json")
    boot = subprocess.run([PY, "-c", "import sys; sys.path.insert(0, %r); import runpy; "
                           "runpy.run_path(%r)" % (str(REPO / "src"), str(REPO / "src/aiprof/agent/preload.py")) +
                           "; import torch; print('job ok')"], capture_output=True, text=True, timeout=120, env=env)
    assert boot.returncode == 0 and "job ok" in boot.stdout
    assert "agent start failed" in boot.stderr and "Traceback" not in boot.stderr


def test_trigger_idle_agent(rt, tmp_path):
    """`aiprof run` without capture options waits; `aiprof trigger` captures and reports where."""
    out = tmp_path / "caps"
    proc = subprocess.Popen([PY, "-m", "aiprof", "run", "--", PY, str(TINY), "--steps", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env_with(rt))
    try:
        sock = wait_for(lambda: list(Path(rt).glob("agent-*.sock")), 60, "the agent's control socket")
        lst = aiprof(rt, "trigger", "--list", "--json")
        (st,) = json.loads(lst.stdout)
        assert st["state"] == "idle" and st["origin"] == "run" and str(st["pid"]) in sock[0].name
        wait_for(lambda: json.loads(aiprof(rt, "trigger", "--list", "--json").stdout)[0]["steps"] > 3, 60, "iterations")
        res = aiprof(rt, "trigger", "-n", "2", "--what", "kernels,hw", "--out", str(out), "--capture-id", "g1",
                     "--json", "--timeout", "60")
        assert res.returncode == 0, res.stdout + res.stderr
        r = json.loads(res.stdout)["results"][str(st["pid"])]
        assert r["ok"] and r["dir"] == str(out / "g1" / "rank0")
        steps = profiler_steps(load_trace(Path(r["dir"])))
        assert steps == r["steps"] and len(steps) == 2
        # a second trigger works too (the agent returned to idle)
        res2 = aiprof(rt, "trigger", "-n", "1", "--out", str(out), "--capture-id", "g2", "--timeout", "60")
        assert res2.returncode == 0 and "g2/rank0" in res2.stdout
    finally:
        stop(proc)
    # SIGTERM skips atexit, so the socket may remain: clients drop sockets of dead processes
    res = aiprof(rt, "trigger", "-n", "1")
    assert res.returncode == 2 and "no aiprof agent is running" in res.stderr
    assert not list(Path(rt).glob("agent-*.sock"))


def test_run_says_why_no_capture(rt, tmp_path):
    """A job that fails before its capture: its exit status and the end of its stderr (still shown
    as it came); one that ends too early: how many iterations the capture needed."""
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--iterations", "2", "--out", str(out), "--", PY, str(tmp_path / "nonexistent.py"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert "can't open file" in lines[0]  # the job's own stderr, passed through
    assert lines[1].startswith("aiprof: no capture: the command exited 2 before its capture (--skip 0 + 2 iteration(s))")
    assert lines[2].startswith("  | ") and "nonexistent.py" in lines[2]
    res = aiprof(rt, "run", "--skip", "20", "--iterations", "2", "--out", str(out), "--", PY, str(TINY), "--steps", "3")
    assert res.returncode == 0
    assert "exited 0 before reaching --skip 20 + 2 iteration(s)" in res.stderr


ITT_JOB = """
import sys, torch
m = torch.nn.Linear(32, 32); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with torch.autograd.profiler.emit_itt():  # a debugging API left on: a range per op
    for i in range(8):
        m(torch.randn(16, 32)).sum().backward(); opt.step(); opt.zero_grad()
for i in range(100):  # more stderr after the agent's line than the tail keeps
    print("log line", i, "x" * 60, file=sys.stderr)
"""


def test_run_names_the_profiler_already_on_in_the_job(rt, tmp_path):
    """emit_itt (as emit_nvtx, which needs CUDA) turns torch's autograd profiler on for the whole
    loop: the agent cannot record beside it. `aiprof run` says so and names it, not "fewer
    iterations ran", however much the job writes to stderr after the agent's line."""
    import pytest
    import torch

    if not torch.profiler.itt.is_available():
        pytest.skip("this torch was built without ITT")
    out = tmp_path / "caps"
    res = aiprof(rt, "run", "--skip", "2", "--iterations", "2", "--out", str(out), "--", PY, "-c", ITT_JOB)
    assert res.returncode == 0, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("aiprof: no capture: the job ran, but the capture failed: "), last
    assert "torch.autograd.profiler.emit_itt()" in last and "turn it off" in last
    assert not (out.exists() and rank_dirs(out))
