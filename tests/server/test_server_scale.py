"""The service's per-arrival work does not grow with the job: a capture's state is parsed once
while its ranks upload (not on every file and result) and written once when they are all in
(results are appended to a log), and a hang snapshot's folder is not listed on every rank's
arrival: it is assembled from the stacks kept in memory. File work is off the event loop: a disk
that stalls an upload's fsync does not hold back a heartbeat. The real app in this process
(Starlette's TestClient, lifespan and ticker running), with os.listdir and the state reads and
writes counted. Throughput is measured by bench/server_load.py, not here."""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time

import pytest
from starlette.testclient import TestClient

from aiprof.server import coordination, store, upload_routes
from aiprof.server.service import create_service

RANKS = 64  # enough that a per-arrival listing or parse would show 64 times over
# A capture's state is parsed once when its first file arrives; every later read is the kept view.
STATE_PARSES_PER_CAPTURE = 1
# Bounded waits on the ticker (TICK_S = 0.5 s) completing what the last arrival started.
SETTLE_S = 30.0


@pytest.fixture
def app(tmp_path):
    app, svc = create_service(str(tmp_path / "data"))
    with TestClient(app, headers={"Authorization": f"Bearer {svc.token}"}) as c:
        for r in range(RANKS):
            c.post("/api/v1/agents", json={"agent_id": f"a{r}", "job": "j", "host": f"h{r // 8}", "pid": 100 + r,
                                           "rank": r, "world_size": RANKS, "steps": 5}).raise_for_status()
        yield c, svc


def _counting(monkeypatch, module, name: str, match) -> list:
    calls: list = []
    real = getattr(module, name)

    def counted(path=".", *a, **kw):
        if match(str(path)):
            calls.append(str(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_capture_uploads_parse_the_state_once(app, monkeypatch):
    c, svc = app
    cid = c.post("/api/v1/jobs/j/captures", json={"request": {"iterations": 1}, "auto_analyze": False}).json()["capture_id"]
    parses = _counting(monkeypatch, store, "read_json", lambda p: p.endswith(os.path.join(cid, store.STATE)))
    writes = _counting(monkeypatch, store, "write_json", lambda p: p.endswith(os.path.join(cid, store.STATE)))
    for r in range(RANKS):
        for name, body in (("trace.json.gz", os.urandom(4096)), ("meta.json", json.dumps({"rank": r}).encode())):
            q = {"offset": 0, "size": len(body), "sha256": hashlib.sha256(body).hexdigest(), "job": "j"}
            res = c.put(f"/api/v1/captures/{cid}/ranks/{r}/files/{name}", params=q, content=body)
            assert res.json()["complete"], res.text
        c.post(f"/api/v1/agents/a{r}/results", json={"capture_id": cid, "rank": r, "ok": True}).raise_for_status()
    assert len(parses) == STATE_PARSES_PER_CAPTURE
    assert len(writes) == 1  # capturing -> uploaded, at the last meta.json; each result is one appended line
    st = c.get(f"/api/v1/captures/{cid}").json()  # from disk: the state file and the results log
    assert st["state"] == "uploaded" and st["received"] == list(range(RANKS)) and len(st["results"]) == RANKS
    again = store.DataDir(svc.ctx.data.root).load_capture(cid)  # as a restarted server reads it
    assert again["results"] == st["results"] and all(v["ok"] for v in again["results"].values())


STUCK = RANKS - 3  # in its data loader while every other rank waits in an all-reduce


def _stacks(rank: int) -> dict:
    inner = ({"function": "load_batch", "file": "/job/data.py", "line": 41, "native": False} if rank == STUCK else
             {"function": "all_reduce", "file": "/usr/lib/python3/torch/distributed/distributed_c10d.py", "line": 2800,
              "native": False})
    return {"pid": 100 + rank, "host": f"h{rank // 8}", "ok": True, "native": False,
            "threads": [{"thread_id": 1, "name": "MainThread", "active": True, "owns_gil": True,
                         "frames": [inner, {"function": "train_step", "file": "/job/train.py", "line": 9,
                                            "native": False}]}]}


def test_hang_snapshot_assembles_without_listing_per_arrival(app, monkeypatch):
    c, svc = app
    sid = c.post("/api/v1/jobs/j/hang", json={"timeout_s": 60}).json()["snapshot_id"]
    hang_dir = svc.ctx.data.hang_dir(sid)
    listed = _counting(monkeypatch, coordination.os, "listdir", lambda p: p == hang_dir)
    state_reads = _counting(monkeypatch, coordination, "read_json", lambda p: p == os.path.join(hang_dir, store.STATE))
    rank_reads = _counting(monkeypatch, coordination, "read_json", lambda p: re.search(r"rank\d+\.json$", p))
    for r in range(RANKS):
        c.post(f"/api/v1/hang/{sid}/ranks/{r}", json=_stacks(r)).raise_for_status()
    assert listed == [] and state_reads == []  # the state and the ranks arrived are kept in memory
    deadline = time.monotonic() + SETTLE_S
    while (st := c.get(f"/api/v1/hang/{sid}").json())["state"] != "analysed":
        assert st["state"] in ("collecting", "analysing") and time.monotonic() < deadline, st
        time.sleep(0.1)  # polling a condition, with a deadline
    assert len(st["result"]["processes"]) == RANKS and st["result"]["missing_ranks"] == []
    assert [o["rank"] for o in st["result"]["outliers"]] == [STUCK]  # the stuck rank is named
    assert listed == [] and rank_reads == []  # assembled from the stacks kept in memory, not read back
    assert st["timing"]["kept_in_memory"] == RANKS and st["timing"]["read_back"] == 0
    assert sorted(os.listdir(hang_dir)) == sorted([store.STATE, "hang.json"] + [f"rank{r}.json" for r in range(RANKS)])


def test_a_slow_disk_does_not_hold_back_heartbeats(app, monkeypatch):
    """An upload's fsync that does not return (a slow or stalled disk) holds its own request only:
    a heartbeat sent meanwhile is answered while that fsync is still blocked."""
    c, svc = app
    cid = c.post("/api/v1/jobs/j/captures", json={"request": {"iterations": 1}, "auto_analyze": False}).json()["capture_id"]
    entered, release = threading.Event(), threading.Event()
    in_fsync = []  # non-empty while the upload's fsync is held
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        if "/.uploads/" in os.readlink(f"/proc/self/fd/{fd}"):
            in_fsync.append(fd)
            entered.set()
            try:
                assert release.wait(SETTLE_S), "the test never released the fsync"
            finally:
                in_fsync.remove(fd)
        real_fsync(fd)
    monkeypatch.setattr(upload_routes.os, "fsync", slow_fsync)
    body = os.urandom(100_000)
    q = {"offset": 0, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("res", c.put(
        f"/api/v1/captures/{cid}/ranks/0/files/trace.json.gz", params=q, content=body)), daemon=True)
    t.start()
    try:
        assert entered.wait(SETTLE_S), "the upload never reached its fsync"
        hb = c.post("/api/v1/agents/a1/heartbeat", json={"steps": 6})
        assert hb.status_code == 200 and in_fsync, "the heartbeat waited for the upload's fsync"
    finally:
        release.set()
        t.join(SETTLE_S)
    assert done["res"].json() == {"complete": True, "received": len(body), "sha256": q["sha256"]}
    assert (svc.ctx.data.file_path(cid, 0, "trace.json.gz") and
            open(svc.ctx.data.file_path(cid, 0, "trace.json.gz"), "rb").read() == body)


def test_a_restarted_server_lists_a_collecting_snapshot_once(tmp_path, monkeypatch):
    """A snapshot a restart interrupted: its folder is listed once, then arrivals are kept."""
    app1, svc1 = create_service(str(tmp_path / "data"))
    sid = "hang-restart"
    d = svc1.ctx.data.hang_dir(sid)
    store.write_json(os.path.join(d, store.STATE), {"snapshot_id": sid, "job": "j", "created": time.time(),
                                                    "deadline": time.time() + 60, "expected": list(range(RANKS)),
                                                    "state": "collecting"})
    for r in range(RANKS // 2):  # half arrived before the restart
        store.write_json(os.path.join(d, f"rank{r}.json"), {**_stacks(r), "rank": r})
    app, svc = create_service(str(tmp_path / "data"))
    listed = _counting(monkeypatch, coordination.os, "listdir", lambda p: p == d)
    with TestClient(app, headers={"Authorization": f"Bearer {svc.token}"}) as c:
        for r in range(RANKS // 2, RANKS):
            c.post(f"/api/v1/hang/{sid}/ranks/{r}", json=_stacks(r)).raise_for_status()
        deadline = time.monotonic() + SETTLE_S
        while (st := c.get(f"/api/v1/hang/{sid}").json())["state"] != "analysed":
            assert time.monotonic() < deadline, st
            time.sleep(0.1)  # polling a condition, with a deadline
    assert len(st["result"]["processes"]) == RANKS
    assert listed == [d]


def test_bytes_waiting_for_the_disk_stay_within_the_budget(app, monkeypatch):
    """With the disk stalled, uploads take in their bodies only while the bytes not yet written
    are within WRITE_BUDGET; the others wait (their clients with them), and past ROOM_WAIT_S are
    answered 503 with what they hold (nothing here). Once the disk moves, every file is whole."""
    c, svc = app
    cid = c.post("/api/v1/jobs/j/captures", json={"request": {"iterations": 1}, "auto_analyze": False}).json()["capture_id"]
    size = 200_000
    budget = 2 * upload_routes.READ_MAX  # room for two bodies (a piece of a body counts as a full read)
    monkeypatch.setattr(upload_routes, "WRITE_BUDGET", budget)
    monkeypatch.setattr(upload_routes, "ROOM_WAIT_S", 2.0)
    entered, release = threading.Semaphore(0), threading.Event()
    real_fsync = os.fsync

    def stalled_fsync(fd: int) -> None:
        if "/.uploads/" in os.readlink(f"/proc/self/fd/{fd}"):
            entered.release()
            assert release.wait(SETTLE_S), "the test never released the fsync"
        real_fsync(fd)
    monkeypatch.setattr(upload_routes.os, "fsync", stalled_fsync)
    bodies = {r: os.urandom(size) for r in range(4)}
    answers: dict = {}

    def put(r: int) -> None:
        q = {"offset": 0, "size": size, "sha256": hashlib.sha256(bodies[r]).hexdigest()}
        answers[r] = c.put(f"/api/v1/captures/{cid}/ranks/{r}/files/trace.json.gz", params=q, content=bodies[r])
    threads = [threading.Thread(target=put, args=(r,), daemon=True) for r in range(4)]
    try:
        for t in threads:
            t.start()
        assert entered.acquire(timeout=SETTLE_S) and entered.acquire(timeout=SETTLE_S), "two uploads reached the disk"
        deadline = time.monotonic() + SETTLE_S  # the two others wait for room, then give up: 503, nothing held
        while len(answers) < 2:
            assert time.monotonic() < deadline, answers
            time.sleep(0.05)  # polling a condition, with a deadline
        refused = sorted(answers)
        assert all(answers[r].status_code == 503 and answers[r].json()["busy"] for r in refused), answers
        assert svc.ctx.stats["upload_buffered_peak"] <= budget
        assert not entered.acquire(blocking=False)  # no third upload reached the disk
    finally:
        release.set()
        for t in threads:
            t.join(SETTLE_S)
    for r in range(4):
        if answers[r].status_code == 503:  # the client's retry, once the disk moves
            q = {"offset": answers[r].json()["received"], "size": size, "sha256": hashlib.sha256(bodies[r]).hexdigest()}
            answers[r] = c.put(f"/api/v1/captures/{cid}/ranks/{r}/files/trace.json.gz", params=q, content=bodies[r])
        assert answers[r].json()["complete"], answers[r].text
        assert open(svc.ctx.data.file_path(cid, r, "trace.json.gz"), "rb").read() == bodies[r]


@pytest.fixture
def live(tmp_path):
    """The real app served by uvicorn on a real socket in this process (its constants can be patched)."""
    import uvicorn

    app, svc = create_service(str(tmp_path / "data"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + SETTLE_S
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)  # polling a condition, with a deadline
    yield svc, server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    t.join(SETTLE_S)


def test_uploads_holding_bytes_do_not_wait_for_each_other(live, monkeypatch):
    """Two uploads hold half their bodies each, the budget full, others waiting: before waiting for
    room for their second halves they write what they hold, so all of them complete (else they
    wait for each other until ROOM_WAIT_S, and all are answered 503)."""
    svc, port = live
    monkeypatch.setattr(upload_routes, "WRITE_BUDGET", 2 * upload_routes.READ_MAX)
    monkeypatch.setattr(upload_routes, "ROOM_WAIT_S", 10.0)
    half = 150_000
    bodies = [os.urandom(2 * half) for _ in range(4)]
    socks = []
    try:
        for r, body in enumerate(bodies):
            s = socket.create_connection(("127.0.0.1", port), timeout=SETTLE_S)
            q = f"offset=0&size={len(body)}&sha256={hashlib.sha256(body).hexdigest()}&job=j&world_size=4"
            s.sendall(f"PUT /api/v1/captures/cap/ranks/{r}/files/trace.json.gz?{q} HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {svc.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:half])
            socks.append(s)
        # the four halves (600 kB) are more than the budget (512 kiB): they are all taken in only
        # if the uploads holding bytes write them instead of waiting with them
        deadline = time.monotonic() + SETTLE_S
        while svc.ctx.stats.get("upload_bytes_received", 0) < len(bodies) * half:
            assert time.monotonic() < deadline, f"the first halves were not all taken in: {svc.ctx.stats}"
            time.sleep(0.02)  # polling a condition, with a deadline
        for s, body in zip(socks, bodies):
            s.sendall(body[half:])
        for r, s in enumerate(socks):
            head = b""
            while b"\r\n\r\n" not in head:
                got = s.recv(65536)
                assert got, f"upload {r}: connection closed without an answer"
                head += got
            assert head.startswith(b"HTTP/1.1 200"), head[:300]
            assert open(svc.ctx.data.file_path("cap", r, "trace.json.gz"), "rb").read() == bodies[r]
    finally:
        for s in socks:
            s.close()
