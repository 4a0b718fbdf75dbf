"""aiprof hang on a real gloo job where one rank blocks in a data-loading function."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiprof.analysis.hang import analyse

SCRIPT = Path(__file__).parent / "scripts" / "hang_job.py"
WORLD, BLOCK = 3, 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stuck_job(tmp_path_factory):
    ready = tmp_path_factory.mktemp("ready")
    port = _port()
    procs = []
    try:
        for r in range(WORLD):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--backend", "gloo", "--block-rank", str(BLOCK),
                                           "--ready-dir", str(ready)], env=env, start_new_session=True))
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < WORLD:
            assert time.monotonic() < deadline, "the job did not reach its hang in 60 s"
            assert all(p.poll() is None for p in procs), "a rank exited"
            time.sleep(0.2)
        time.sleep(1.0)  # let the others enter all_reduce
        yield procs, port
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=10)


def _hang_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", "hang", *args], capture_output=True, text=True, timeout=90)


def test_hang_json_names_the_blocked_rank(stuck_job):
    procs, port = stuck_job
    r = _hang_cli("--job", f"127.0.0.1:{port}", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert sorted(p["rank"] for p in res["processes"]) == list(range(WORLD))
    assert {p["pid"] for p in res["processes"]} == {p.pid for p in procs}
    # the others are grouped in the collective...
    g0 = res["groups"][0]
    assert g0["ranks"] == [0, 1] and g0["collective"] == "all_reduce"
    # ...and the blocked rank is the one outlier, caught in its data-loading function
    assert [(o["rank"], o["pid"]) for o in res["outliers"]] == [(BLOCK, procs[BLOCK].pid)]
    out = res["outliers"][0]
    assert "not in a collective" in out["reason"] and "load_batch" in out["reason"]
    assert out["stack"][0].startswith(("load_batch", "sleep"))
    (hang,) = res["findings"]
    assert hang["code"] == "HANG" and hang["rank"] == BLOCK


def test_hang_text_by_pid_and_from_file(stuck_job, tmp_path):
    procs, _ = stuck_job
    r = _hang_cli(*[str(p.pid) for p in procs])
    assert r.returncode == 0, r.stderr
    assert f"rank {BLOCK} (pid {procs[BLOCK].pid}): not in a collective" in r.stdout
    assert "HANG" in r.stdout
    # a saved snapshot analyses to the same answer
    snap = tmp_path / "snap.json"
    snap.write_text(_hang_cli("--json", *[str(p.pid) for p in procs]).stdout)
    r2 = _hang_cli("--from", str(snap), "--json")
    assert [o["rank"] for o in json.loads(r2.stdout)["outliers"]] == [BLOCK]


def test_hang_user_errors():
    r = _hang_cli("--job", "no-such-job-key-xyz")
    assert r.returncode == 2 and r.stderr.startswith("aiprof: error:") and len(r.stderr.splitlines()) == 1


def _proc(pid, rank, frames):
    return {"pid": pid, "rank": rank, "ok": True, "threads": [
        {"os_thread_id": pid, "name": "MainThread", "frames": [
            {"function": f, "file": p, "line": 1, "native": False} for f, p in frames]}]}


C10D = "/x/site-packages/torch/distributed/distributed_c10d.py"


def test_rules_majority_without_collectives_and_no_majority():
    a = [("sleep", "/u/train.py"), ("main", "/u/train.py")]
    b = [("read", "/u/io.py"), ("main", "/u/train.py")]
    res = analyse([_proc(10 + i, i, a) for i in range(7)] + [_proc(99, 7, b)])
    assert [o["rank"] for o in res["outliers"]] == [7] and "differs from the majority (7 of 8" in res["outliers"][0]["reason"]
    # two workers, two stacks, no collective: nobody can be called the odd one out
    assert analyse([_proc(1, 0, a), _proc(2, 1, b)])["outliers"] == []
    # 2 ranks: the one in all_reduce waits for the other
    c = [("all_reduce", C10D), ("step", "/u/train.py")]
    res = analyse([_proc(1, 0, c), _proc(2, 1, b)])
    assert [o["rank"] for o in res["outliers"]] == [1]
    # most ranks outside collectives: the one inside a collective waits, it is not blamed
    res = analyse([_proc(i, i, b) for i in range(3)] + [_proc(9, 3, c)])
    assert res["outliers"] == [] and res["groups"][0]["ranks"] == [0, 1, 2]


def test_real_nccl_snapshot_from_h200():
    # `aiprof hang --job --json` of a live 4-rank NCCL job (tests/data/README.md): rank 1 stuck
    data = Path(__file__).parents[1] / "data" / "hang_nccl_h200x4.json"
    r = _hang_cli("--from", str(data), "--json")
    res = json.loads(r.stdout)
    assert [o["rank"] for o in res["outliers"]] == [1] and "load_batch" in res["outliers"][0]["reason"]
    assert res["groups"][0]["ranks"] == [0, 2, 3]


def test_real_nccl_snapshot_with_recorder_from_h200():
    # the same hang under `aiprof run` (bench/hang_gpu.sh): the agents' recorder tells who is behind
    data = Path(__file__).parents[1] / "data" / "hang_nccl_recorder_h200x4.json"
    res = json.loads(_hang_cli("--from", str(data), "--json").stdout)
    waiting, behind = res["collectives"]["groups"]
    assert (waiting["ranks"], waiting["label"]) == ([0, 2, 3], "in all_reduce #4")
    assert (behind["ranks"], behind["label"]) == ([1], "last collective all_reduce #3")
    (out,) = res["outliers"]
    assert out["rank"] == 1 and out["kind"] == "behind" and "load_batch" in out["reason"]
    # the stacks alone could not say it: the waiting ranks' stacks left all_reduce (NCCL returns at once)
    from aiprof.analysis.hang import main_thread

    assert all(not any(f["function"] == "all_reduce" for f in main_thread(p)["frames"]) for p in res["processes"])
    assert res["groups"][0]["collective"] == "all_reduce"  # from the recorder


def test_real_ddp_snapshot_from_torch_flight_recorder_h200():
    # a 4-rank DDP job under `aiprof run` on H200s, rank 1 stuck (bench/hang_gpu.sh's DDP case):
    # DDP's all-reduce comes from C++, so only torch's NCCL flight recorder sees it
    data = Path(__file__).parents[1] / "data" / "hang_ddp_flightrec_h200x4.json"
    res = json.loads(_hang_cli("--from", str(data), "--json").stdout)
    waiting, behind = res["collectives"]["groups"]
    assert (waiting["ranks"], waiting["label"]) == ([0, 2, 3], "in all_reduce #9")
    assert (behind["ranks"], behind["label"]) == ([1], "last collective all_reduce #8")
    assert res["collectives"]["source"] == "flight_recorder"
    (out,) = res["outliers"]
    assert out["rank"] == 1 and out["kind"] == "behind" and "load_batch" in out["reason"]
