"""The Ray engine, for real: a local Ray that aiprof starts (not mocked), on small multi-rank
captures. Its reports must be the in-process per-rank pipeline's, field for field (same tasks,
other processes), and the in-process report's where the pipeline gives it (two ranks)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from aiprof.pipeline import build_report
from aiprof.errors import AiprofError
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files, open_capture

from tests.deps import need

need("ray")
CPUS = 2  # CI has two cores


@pytest.fixture(scope="module")
def ray_engine():
    with engines.RayEngine(cpus=CPUS) as eng:
        yield eng


def test_ray_report_equals_the_in_process_one(ray_engine, ddp4_dir):
    """ddp4 (4 ranks, rank 2 the straggler): Ray and this process run the same tasks."""
    files = find_trace_files([str(ddp4_dir)])
    got = build_job_report(files, ray_engine)
    with engines.SerialEngine() as serial:
        want = build_job_report(files, serial)
    assert got == want
    assert got["ranks"] == build_report(open_capture(files))["ranks"]
    assert [s["straggler_rank"] for s in got["cross_rank"]["stragglers"]] == [2]
    assert got["causes"][0]["code"] == "STRAGGLER" and got["causes"][0]["rank"] == 2
    st = ray_engine.stats.by_phase
    assert st["ingest"]["tasks"] >= 4 and st["analyse"]["tasks"] >= 4 and st["stragglers"]["tasks"] >= 1
    assert all(ph["task_wall_s"] > 0 for ph in st.values())  # each task's own wall time, where it ran


@pytest.mark.parametrize("pair, code", [("accum2", "GRAD_ACCUM_ALLREDUCE"), ("slow_transport2", "SLOW_INTERCONNECT")])
def test_job_causes_on_ray_give_the_in_process_report(ray_engine, tmp_path, pair, code):
    """The job-wide causes on Ray: accum2 (gloo, gradient accumulation) and slow_transport2
    (NCCL over sockets on two H200s), each detected on the lowest rank, priced on both, claims
    on every rank: the whole report equals the in-process one."""
    import shutil

    from tests.conftest import DATA

    for r in (0, 1):
        shutil.copy(DATA / "diagnosis" / f"{pair}_fault_rank{r}.json.gz", tmp_path)
    files = find_trace_files([str(tmp_path)])
    got = build_job_report(files, ray_engine)
    assert got == build_report(open_capture(files))
    assert got["causes"][0]["code"] == code


def test_a_bad_trace_is_one_line_from_a_worker(ray_engine, ddp4_dir, tmp_path):
    bad = tmp_path / "rank9.json"
    bad.write_text('{"schemaVersion": 1}')
    files = [*find_trace_files([str(ddp4_dir)]), str(bad)]
    with pytest.raises(AiprofError, match=r"rank9\.json: .*traceEvents"):
        build_job_report(files, ray_engine)


# Runs an analysis on a fresh embedded Ray in its own process (this one's tests share a Ray,
# started by the module's fixture, which an engine would use as it is) and prints what the
# tests below check, as JSON. argv: the capture, then "bad" to add a broken trace first.
BESIDE_START = """\
import json, multiprocessing, sys, time
from aiprof.errors import AiprofError
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files

files = find_trace_files([sys.argv[1]])
if sys.argv[2:3] == ["bad"]:
    files = [sys.argv[3], *files]
out = {}
try:
    with engines.RayEngine(cpus=2) as eng:
        out["report"] = build_job_report(files, eng)
        out["node"] = eng.ray.get_runtime_context().get_node_id()
except AiprofError as exc:
    out["error"] = str(exc)
with engines.SerialEngine() as serial:
    out["same"] = "report" in out and out.pop("report") == build_job_report(files, serial)
out["phases"] = eng.stats.by_phase
end = time.monotonic() + 30  # the pool's own thread reaps its processes once their last task ends
while multiprocessing.active_children() and time.monotonic() < end:
    time.sleep(0.05)
out["pool_left"] = len(multiprocessing.active_children())
print(json.dumps(out))
"""


def _beside_start(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", BESIDE_START, *args], check=False, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_first_phase_runs_beside_rays_start(ddp4_dir):
    """While the embedded Ray starts, the first phase's tasks run in processes forked from the
    driver (engines.RAY_START_CPUS: one beside a Ray of two CPUs): some ingest tasks end before
    Ray is up, counted where they ran (the local Ray's one node); Ray runs the rest and every
    later phase. The report is the per-rank pipeline's in one process; no pool process is left."""
    got = _beside_start(str(ddp4_dir))
    assert got["same"] and got["pool_left"] == 0
    st = got["phases"]
    assert 1 <= st["ingest"]["before_ray"] <= st["ingest"]["tasks"] == 4
    assert st["ingest"]["nodes"] == {got["node"]: 4}
    assert not any("before_ray" in v for ph, v in st.items() if ph != "ingest")


def test_a_bad_trace_beside_rays_start_is_one_line(ddp4_dir, tmp_path):
    """A trace that fails in a pool process (the first call: the pool begins it at once) ends
    the analysis with the one-line error a Ray worker's failure gives."""
    bad = tmp_path / "rank9.json"
    bad.write_text('{"schemaVersion": 1}')
    got = _beside_start(str(ddp4_dir), "bad", str(bad))
    assert re.search(r"rank9\.json: .*traceEvents", got["error"]), got
    assert got["pool_left"] == 0


SCRIPT = """\
# no `if __name__ == "__main__":` guard, on purpose: Ray's workers must not run this again
import os, sys
with open(sys.argv[1], "a") as f:
    f.write("ran\\n")
from aiprof.cli.main import main
rc = main(["analyze", sys.argv[2], "--engine", "ray", "--workers", "2", "--no-cache", "--json", "--out", sys.argv[3],
           "--stats", sys.argv[4], "--progress-file", sys.argv[5]])
print("rc", rc, file=sys.stderr)
"""


def test_cli_on_ray_never_reruns_the_callers_main(ddp4_dir, tmp_path):
    """`aiprof analyze --engine ray` from a script without a main guard: the script's top
    level runs once, the JSON report is the in-process pipeline's, the stats are written."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    marker, out, stats, prog = tmp_path / "ran.txt", tmp_path / "out", tmp_path / "stats.json", tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(script), str(marker), str(ddp4_dir), str(out), str(stats), str(prog)],
                       check=False, capture_output=True, text=True, timeout=600)
    assert "rc 0" in p.stderr, p.stderr[-3000:]
    assert marker.read_text() == "ran\n"
    rep = json.loads(p.stdout)
    assert rep == json.loads((out / "report.json").read_text())
    assert [s["straggler_rank"] for s in rep["cross_rank"]["stragglers"]] == [2]
    st = json.loads(stats.read_text())
    assert st["engine"] == "ray" and st["ranks"] == 4 and st["worker_cpu_s"] > 0 and st["driver_peak_rss_mb"] > 0
    # the driver's own steps, each timed (docs/scale.md): together less than the run's wall
    steps = ("import_ray_s", "engine_start_s", "match_s", "compare_s", "assemble_s", "engine_stop_s", "encode_s")
    assert set(st["driver"]) == set(steps) and all(st["driver"][k] > 0 for k in steps)
    assert sum(st["driver"].values()) < st["wall_s"]
    assert json.loads(prog.read_text())["phases"] == {"starting ray": [1, 1], "ingest": [4, 4], "analyse": [4, 4],
                                                      "stragglers": [1, 1]}


# Says, as the interpreter exits, whether Ray was imported (a sitecustomize on PYTHONPATH).
RAY_IMPORTED = """\
import atexit, os, sys

def _say():
    with open(os.environ["AIPROF_TEST_RAY_IMPORTED"], "w") as f:
        f.write(str("ray" in sys.modules))

atexit.register(_say)
"""


def test_cli_reads_kept_results_without_starting_ray(tmp_path):
    """A second `aiprof analyze --engine ray` of an unchanged capture reads every rank's kept
    results (scale.results): no task runs and the embedded Ray is never started (the progress
    file has no "starting ray"), nor imported; the report is the first run's, byte for byte."""
    import os
    import shutil

    from tests.conftest import DATA

    cap = tmp_path / "cap"
    cap.mkdir()
    for r in range(4):
        shutil.copy(DATA / f"ddp4_slow2_rank{r}.json.gz", cap)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RAY_IMPORTED)
    said = tmp_path / "ray_imported.txt"
    env = dict(os.environ, AIPROF_TEST_RAY_IMPORTED=str(said),
               PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    runs = []
    for n in range(2):
        stats, prog = tmp_path / f"s{n}.json", tmp_path / f"p{n}.json"
        p = subprocess.run([sys.executable, "-m", "aiprof", "analyze", str(cap), "--engine", "ray", "--workers", "2",
                            "--json", "--stats", str(stats), "--progress-file", str(prog)],
                           check=False, capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append((p.stdout, json.loads(stats.read_text()), json.loads(prog.read_text())["phases"],
                     said.read_text()))
    (out1, st1, ph1, imported1), (out2, st2, ph2, imported2) = runs
    assert (imported1, imported2) == ("True", "False")
    assert ph1["starting ray"] == [1, 1] and {k: v["tasks"] for k, v in st1["phases"].items()} == \
        {"ingest": 4, "analyse": 4, "stragglers": 1}
    assert ph2 == {"ingest": [4, 4], "analyse": [4, 4], "stragglers": [1, 1]}
    assert {k: (v["tasks"], v["reused"]) for k, v in st2["phases"].items()} == \
        {"ingest": (0, 4), "analyse": (0, 4), "stragglers": (0, 1)}
    assert st2["worker_cpu_s"] == 0
    assert out2 == out1


STOP_SCRIPT = """\
import json, os, sys
import psutil
from aiprof.scale import engines

me = psutil.Process()
eng = engines.RayEngine(cpus=1)
assert eng.cpus == 1  # starts the local Ray
started = me.children()
names = {p.pid: " ".join(p.cmdline()[:2]) for p in started}


def alive(p):  # running and not a zombie; gone in between counts as gone
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# the autoscaler monitor (ray/autoscaler/_private/monitor.py), not log_monitor.py
monitor = [p for p in started if any(os.path.basename(a) == "monitor.py" for a in p.cmdline())]
engines._kill_monitor()
killed = [not alive(p) for p in monitor]
others_up = all(alive(p) for p in started if p not in monitor)
eng.close()
left = [names[p.pid] for p in started if alive(p)]
print(json.dumps({"monitor": len(monitor), "killed": killed, "others_up": others_up, "left": left}))
"""


def test_close_kills_the_monitor_first_and_leaves_no_ray_process(tmp_path):
    """The embedded Ray's autoscaler monitor is killed before ray.shutdown() (which would wait a
    second for it: engines._kill_monitor), the rest of Ray still up; after close() nothing Ray
    started from this process is left. In a process of its own: one Ray per process."""
    need("psutil")
    script = tmp_path / "stop.py"
    script.write_text(STOP_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"monitor": 1, "killed": [True], "others_up": True, "left": []}


# An analysis whose driver writes argv[2] as the embedded Ray begins to start (the pool beside
# it forked by then), to be killed there by the test below.
KILLED_DRIVER = """\
import sys
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files

def starting(phase, done, total):
    if done == 0:
        open(sys.argv[2], "w").close()

with engines.RayEngine(cpus=2, on_start=starting) as eng:
    build_job_report(find_trace_files([sys.argv[1]]), eng)
"""


def test_pool_processes_die_with_a_killed_driver(ddp4_dir, tmp_path):
    """A driver killed (SIGKILL) while Ray starts leaves no pool process behind: each dies with
    it (PR_SET_PDEATHSIG), where it would wait on the pool's queue for ever."""
    import signal
    import time

    need("psutil")
    import psutil

    marker = tmp_path / "starting"
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(ddp4_dir), str(marker)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    family: list = []
    try:
        end = time.monotonic() + 300
        while not marker.exists() and driver.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
        assert marker.exists(), "the driver never began to start Ray"
        me = psutil.Process(driver.pid)
        command = me.cmdline()
        family = me.children(recursive=True)  # the pool's process, and whatever of Ray has begun

        def forked(p: psutil.Process) -> bool:  # a fork runs the driver's command line
            try:
                return p.cmdline() == command
            except psutil.Error:  # gone meanwhile (one of Ray's short-lived processes)
                return False

        pool = [p for p in family if forked(p)]
        assert pool, f"no pool process among the driver's {len(family)} children"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
        _, alive = psutil.wait_procs(pool, timeout=30)
        assert not alive
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=60)
        for p in family:  # Ray's processes begun before the kill: not this test's subject
            try:
                p.kill()
            except psutil.Error:
                pass
