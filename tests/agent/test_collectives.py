"""Collective flight recorder (agent/collectives.py) and `aiprof hang` on a real gloo job.

The job (tests/attach/scripts/hang_job.py) runs 3 ranks, each under `aiprof run`; at step 3,
rank 2 blocks in load_batch() while ranks 0 and 1 enter all_reduce and wait there.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from capsupport import PY, REPO, env_with

from aiprof.agent import collectives as C
from aiprof.analysis.hang import analyse

SCRIPT = REPO / "tests" / "attach" / "scripts" / "hang_job.py"
WORLD, BLOCK, BLOCK_AT = 3, 2, 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stuck_job(tmp_path_factory):
    """3 ranks under `aiprof run`; rank 2 stuck in load_batch, ranks 0 and 1 in all_reduce."""
    ready = tmp_path_factory.mktemp("ready")
    rt = str(tmp_path_factory.mktemp("rt"))
    port = _port()
    procs = []
    try:
        for r in range(WORLD):
            env = env_with(rt, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           OMP_NUM_THREADS="1")
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
            procs.append(subprocess.Popen([PY, "-m", "aiprof", "run", "--", PY, str(SCRIPT), "--backend", "gloo",
                                           "--block-rank", str(BLOCK), "--block-at", str(BLOCK_AT),
                                           "--ready-dir", str(ready)], env=env, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < WORLD or len(list(Path(rt).glob("agent-*.sock"))) < WORLD:
            assert time.monotonic() < deadline, "the job did not reach its hang in 60 s"
            assert all(p.poll() is None for p in procs), "a rank exited"
            time.sleep(0.2)
        time.sleep(1.0)  # let ranks 0 and 1 enter all_reduce
        yield procs, port, rt
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=10)


def _check(res: dict, source: str) -> None:
    assert sorted(p["rank"] for p in res["processes"]) == list(range(WORLD))
    coll = res["collectives"]
    assert coll["source"] == source
    top = coll["top_seq"]
    waiting, behind = coll["groups"]
    assert waiting == {**waiting, "op": "all_reduce", "seq": top, "ranks": [0, 1], "state": "waiting",
                       "label": f"in all_reduce #{top}"}
    assert behind == {**behind, "op": "all_reduce", "seq": top - 1, "ranks": [BLOCK], "state": "behind",
                      "label": f"last collective all_reduce #{top - 1}"}
    assert top >= BLOCK_AT + 1  # the steps before the hang each ran one all_reduce
    (out,) = res["outliers"]
    assert out["rank"] == BLOCK and out["kind"] == "behind"
    assert out["reason"].startswith(f"behind: last collective all_reduce #{top - 1} while 2 of 3 workers are in "
                                    f"all_reduce #{top}")
    assert "load_batch" in out["reason"]
    assert res["groups"][0]["ranks"] == [0, 1] and res["groups"][0]["recorded"] == f"in all_reduce #{top}"
    (hang,) = res["findings"]
    assert hang["code"] == "HANG" and hang["rank"] == BLOCK and f"in all_reduce #{top}" in hang["suggestion"]


def test_hang_cli_reports_recorded_collectives(stuck_job):
    procs, port, rt = stuck_job
    r = subprocess.run([PY, "-m", "aiprof", "hang", "--job", f"127.0.0.1:{port}", "--json"], capture_output=True,
                       text=True, timeout=60, env=env_with(rt))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    # the workers, not the `aiprof run` processes that started them
    assert all(p["pid"] not in {q.pid for q in procs} for p in res["processes"])
    by_rank = {p["rank"]: p for p in res["processes"]}
    for rank in range(WORLD):
        lc = by_rank[rank]["last_collectives"]
        assert lc["installed"] and lc["failures"] == 0
        py = lc["python"][-1]
        assert py["op"] == "all_reduce" and py["pg_size"] == WORLD and py["shape"] == [64, 64] and py["dtype"] == "float32"
        # ranks 0 and 1 are still inside their all_reduce; rank 2's last one returned
        assert py["state"] == ("returned" if rank == BLOCK else "entered")
        assert (py["returned_ns"] is None) == (rank != BLOCK)
    # the agent turned torch's flight recorder on (this torch has it for gloo): both sources agree
    fr_all = [by_rank[r]["last_collectives"]["flight_recorder"] for r in range(WORLD)]
    if all(fr_all):
        _check(res, "flight_recorder")
        assert [f[-1]["seq"] for f in fr_all] == [by_rank[r]["last_collectives"]["python"][-1]["seq"]
                                                  for r in range(WORLD)]
    else:
        _check(res, "python")
    _check(analyse(res["processes"], recorder_source="python"), "python")
    # the text form says the same
    r2 = subprocess.run([PY, "-m", "aiprof", "hang", "--job", f"127.0.0.1:{port}"], capture_output=True, text=True,
                        timeout=60, env=env_with(rt))
    top = res["collectives"]["top_seq"]
    assert f"ranks 0, 1: in all_reduce #{top}" in r2.stdout
    assert f"rank {BLOCK} (pid {by_rank[BLOCK]['pid']}): behind: last collective all_reduce #{top - 1}" in r2.stdout


def test_library_snapshot_without_py_spy(stuck_job, monkeypatch):
    """hangsnap.snapshot() as a library call; with py-spy gone, the agents' own stacks serve."""
    from aiprof.attach import hangsnap
    from aiprof.errors import AiprofError

    _, port, rt = stuck_job
    monkeypatch.setenv("AIPROF_RUNTIME_DIR", rt)
    pids, ranks = hangsnap.targets(None, None, f"127.0.0.1:{port}", True)

    def no_py_spy() -> str:
        raise AiprofError("py-spy not found")

    monkeypatch.setattr(hangsnap, "find_py_spy", no_py_spy)
    res = hangsnap.snapshot(pids, ranks)
    assert {p["source"] for p in res["processes"]} == {"agent"}
    _check(res, res["collectives"]["source"])


# -- unit tests of the recorder (this process, a world of one over gloo) ---------------------------


@pytest.fixture
def world_of_one():
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_port()}")
    C.uninstall()
    C.RECORDER.ring.clear()
    assert C.install("attach")
    yield
    C.uninstall()


def test_ring_buffer_is_bounded(world_of_one):
    t = torch.ones(3)
    before = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    for _ in range(C.RING_SIZE + 10):
        dist.all_reduce(t)
    assert len(C.RECORDER.ring) == C.RING_SIZE
    ents = C.RECORDER.entries(C.RING_SIZE)
    assert [e["seq"] for e in ents] == list(range(before + 11, before + C.RING_SIZE + 11))
    assert len(C.snapshot()["python"]) == C.REPORT_LAST
    # async work: pending until someone looks after it finished
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    assert C.RECORDER.entries(1)[0]["state"] == "completed"
    # a nested collective (all_gather_object calls all_gather) is recorded once, as the outer call
    n = C.RECORDER.calls
    out = [None]
    dist.all_gather_object(out, {"a": 1})
    assert out == [{"a": 1}] and C.RECORDER.calls == n + 1 and C.RECORDER.entries(1)[0]["op"] == "all_gather_object"


def test_wrapper_never_raises_into_user_code(world_of_one, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("recorder broken")

    monkeypatch.setattr(C.RECORDER, "enter", broken)
    t = torch.ones(2)
    failures = C.RECORDER.failures
    dist.all_reduce(t)  # the call goes on
    dist.barrier()
    assert t.tolist() == [1.0, 1.0] and C.RECORDER.failures == failures + 2
    # ...and the user's own errors still reach the user, unchanged
    monkeypatch.undo()
    with pytest.raises(TypeError):
        dist.all_reduce("not a tensor")
    assert C.RECORDER.entries(1)[0]["state"] == "raised"
