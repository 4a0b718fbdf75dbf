"""Uploads the service refuses (a rank outside the capture) and uploads it resumes after a restart
from what it had fsync'd, over real HTTP to a real ``aiprof server`` on 127.0.0.1."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from srvsupport import PY, start_server

from aiprof.server.client import ServerClient, ServerError, file_sha256
from aiprof.server.upload_routes import DURABLE_EVERY


def _refused(fn, *args, **kw) -> ServerError:
    with pytest.raises(ServerError) as e:
        fn(*args, **kw)
    return e.value


def _blob(path: Path, n: int) -> Path:
    path.write_bytes(os.urandom(n))
    return path


def test_a_rank_outside_the_capture_is_refused_before_any_byte_is_stored(server, tmp_path):
    c = server.client()
    f = _blob(tmp_path / "t.bin", 10_000)
    caps = server.data / "captures"
    # a capture the server triggered for a one-rank job: rank 999 is not part of it
    c.post("agents", {"agent_id": "h-0", "job": "one", "host": "h", "pid": 1, "rank": 0, "world_size": 1,
                      "steps": 10, "step_ms": 50.0})
    cid = c.post("jobs/one/captures", {"request": {"iterations": 2}, "auto_analyze": False})["capture_id"]
    e = _refused(c.upload_file, cid, 999, str(f), "trace.json.gz", attempts=1)
    assert e.status == 400 and f"rank 999 is not part of capture {cid} (its ranks: 0)" in str(e)
    assert not (caps / cid / "rank999").exists()
    e = _refused(c.post, "agents/h-0/results", {"capture_id": cid, "rank": 999, "ok": False, "error": "x"})
    assert e.status == 400 and "rank 999" in str(e)
    assert c.upload_file(cid, 0, str(f), "trace.json.gz").sent == 10_000  # its own rank is taken

    # a capture an agent took by itself: its first upload names the world size ...
    c.upload_file("agent-cap", 0, str(f), "trace.json.gz", world_size=2)
    c.upload_file("agent-cap", 1, str(f), "trace.json.gz", world_size=2)
    e = _refused(c.upload_file, "agent-cap", 999, str(f), "trace.json.gz", attempts=1)  # a client naming none
    assert e.status == 400 and "its ranks: 0-1" in str(e)
    # ... or it was taken by one rank alone (the auto-trigger): no other rank belongs to it
    c.upload_file("solo-cap", 3, str(f), "trace.json.gz", world_size=8, scope="rank")
    e = _refused(c.upload_file, "solo-cap", 0, str(f), "trace.json.gz", world_size=8, attempts=1)
    assert e.status == 400 and "its ranks: 3" in str(e)
    # a new capture whose first upload is outside its own world size
    e = _refused(c.upload_file, "new-cap", 999, str(f), "trace.json.gz", world_size=1, attempts=1)
    assert e.status == 400 and "world size 1" in str(e)
    assert not (caps / "new-cap").exists()
    # an uploader that names nothing: the capture learns its ranks from its first meta.json
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"schema": "aiprof.capture/1", "rank": 0, "world_size": 1}))
    c.upload_file("old-cap", 0, str(f), "trace.json.gz")
    c.upload_file("old-cap", 0, str(meta), "meta.json")
    e = _refused(c.upload_file, "old-cap", 999, str(f), "trace.json.gz", attempts=1)
    assert e.status == 400 and "its ranks: 0" in str(e)
    assert sorted(p.name for p in (caps / "old-cap").iterdir() if p.name.startswith("rank")) == ["rank0"]


def test_hang_snapshot_refuses_a_rank_that_was_not_asked(server):
    c = server.client()
    c.post("agents", {"agent_id": "s-0", "job": "hj", "host": "h", "pid": 1, "rank": 0, "world_size": 1, "steps": 3})
    sid = c.post("jobs/hj/hang", {"timeout_s": 30})["snapshot_id"]
    e = _refused(c.post, f"hang/{sid}/ranks/5", {"threads": []})
    assert e.status == 400 and "rank 5 is not part of snapshot" in str(e)
    assert not (server.data / "hang" / sid / "rank5.json").exists()


def test_aiprof_upload_of_a_misnamed_rank_folder_says_why(server, tmp_path):
    """A rank folder whose meta.json says world size 1 but whose name says rank 999."""
    d = tmp_path / "caps" / "c9" / "rank999"
    d.mkdir(parents=True)
    _blob(d / "trace.json.gz", 2000)
    (d / "meta.json").write_text(json.dumps({"schema": "aiprof.capture/1", "rank": 999, "world_size": 1}))
    env = dict(os.environ, AIPROF_TOKEN=server.token)
    r = subprocess.run([PY, "-m", "aiprof", "upload", "--all", "--server", server.url, str(tmp_path / "caps")],
                       check=False, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "HTTP 400: rank 999 is not part of a job of world size 1" in r.stdout, r.stdout + r.stderr
    assert not (server.data / "captures" / "c9").exists()


def _start_put(server, cid: str, name: str, size: int, sha: str) -> socket.socket:
    """A PUT whose body follows later (sent by the caller, on the returned socket)."""
    host, port = server.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    path = server.client().file_path(cid, 0, name) + f"?offset=0&size={size}&sha256={sha}"
    s.sendall(f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {server.token}\r\n"
              f"Content-Length: {size}\r\n\r\n".encode())
    return s


def _durable_bytes(server, cid: str, name: str) -> int:
    try:
        return json.loads((server.data / "captures" / cid / "rank0" / ".uploads" / f"{name}.durable").read_text())["bytes"]
    except (OSError, ValueError, KeyError):
        return 0


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_upload_resumes_after_a_crash_from_the_fsynced_bytes_not_from_0(tmp_path):
    data = tmp_path / "data"
    srv = start_server(data)
    port = int(srv.url.rsplit(":", 1)[1])
    src = _blob(tmp_path / "trace.json.gz", 3 * DURABLE_EVERY + 12_345)
    sha, size = file_sha256(str(src))
    body = src.read_bytes()
    sent = 2 * DURABLE_EVERY + 4321  # two fsync points passed, the third not reached
    try:
        sock = _start_put(srv, "crash", "trace.json.gz", size, sha)
        sock.sendall(body[:sent])
        _wait(lambda: _durable_bytes(srv, "crash", "trace.json.gz") == 2 * DURABLE_EVERY, "the second fsync point")
        srv.proc.kill()  # a crash: no chance to sync what came after
        srv.proc.wait(10)
        sock.close()
    finally:
        srv.stop()
    part = data / "captures" / "crash" / "rank0" / ".uploads" / "trace.json.gz.part"
    # what a power cut may leave past the last fsync: a tail of the right length with the wrong bytes
    with open(part, "r+b") as f:
        f.seek(2 * DURABLE_EVERY)
        f.write(b"\0" * (sent - 2 * DURABLE_EVERY))
    srv2 = start_server(data, port)
    try:
        c = srv2.client()
        assert c.get(c.file_path("crash", 0, "trace.json.gz")) == {"complete": False, "received": 2 * DURABLE_EVERY}
        res = c.upload_file("crash", 0, str(src))
        assert (res.resumed_from, res.sent, res.attempts) == (2 * DURABLE_EVERY, size - 2 * DURABLE_EVERY, 1)
        assert (data / "captures" / "crash" / "rank0" / "trace.json.gz").read_bytes() == body
        assert not part.exists() and not part.with_suffix(".durable").exists()
    finally:
        srv2.stop()


def test_a_broken_connection_keeps_every_byte_that_arrived_across_a_restart(tmp_path):
    data = tmp_path / "data"
    srv = start_server(data)
    port = int(srv.url.rsplit(":", 1)[1])
    src = _blob(tmp_path / "hw.csv", DURABLE_EVERY // 2)
    sha, size = file_sha256(str(src))
    body = src.read_bytes()
    try:
        sock = _start_put(srv, "drop", "hw.csv", size, sha)
        sock.sendall(body[:300_000])
        sock.close()  # the uploader died: the server syncs what it got
        _wait(lambda: _durable_bytes(srv, "drop", "hw.csv") > 0, "the sync at disconnect")
        held = _durable_bytes(srv, "drop", "hw.csv")
        assert 0 < held <= 300_000
    finally:
        srv.stop()
    srv2 = start_server(data, port)
    try:
        c = srv2.client()
        assert c.get(c.file_path("drop", 0, "hw.csv"))["received"] == held
        # the file changed on the uploader's side meanwhile: the partial copy is of another file
        other = _blob(tmp_path / "other.csv", size)
        e = _refused(c.request, "PUT", c.file_path("drop", 0, "hw.csv"), raw=b"",
                     query={"offset": held, "size": size, "sha256": file_sha256(str(other))[0]})
        assert e.status == 409 and e.body["received"] == 0 and "belong to another file" in str(e)
        res = c.upload_file("drop", 0, str(other), "hw.csv")
        assert res.resumed_from == 0 and (data / "captures" / "drop" / "rank0" / "hw.csv").read_bytes() == other.read_bytes()
    finally:
        srv2.stop()


def test_a_small_file_sent_whole_resumes_from_what_the_server_holds(server, tmp_path):
    """A file of one block goes in one PUT from 0 without asking first; when the server holds part
    of it already (a cut-off earlier upload), its 409 says how much, and the client sends the rest."""
    src = _blob(tmp_path / "hw.csv", 300_000)
    sha, size = file_sha256(str(src))
    body = src.read_bytes()
    c = server.client()
    held = 120_000
    r = c.request("PUT", c.file_path("small", 0, "hw.csv"), raw=body[:held], query={"offset": 0, "size": size, "sha256": sha})
    assert r == {"complete": False, "received": held}  # the connection ended: what arrived is kept
    res = c.upload_file("small", 0, str(src))
    assert (res.attempts, res.resumed_from, res.sent) == (2, held, size - held)
    assert (server.data / "captures" / "small" / "rank0" / "hw.csv").read_bytes() == body
    assert not list((server.data / "captures" / "small" / "rank0" / ".uploads").glob("hw.csv.*part"))


def test_a_kept_connection_is_reused_and_replaced_after_a_server_restart(tmp_path):
    """The agent's client keeps one connection per thread; a server that restarted (the kept
    connection dead) is reached again on a new one, with no error for the caller."""
    data = tmp_path / "data"
    srv = start_server(data)
    port = int(srv.url.rsplit(":", 1)[1])
    c = ServerClient(srv.url, srv.token, timeout=10.0, keep_alive=True)
    try:
        c.get("health")
        first = c._local.conn.sock
        assert c.get("health") == {"ok": True} and c._local.conn.sock is first  # reused
        srv.stop()
        srv = start_server(data, port)
        assert c.get("health") == {"ok": True}  # the dead connection replaced once, transparently
        assert c._local.conn.sock is not first
    finally:
        c.close()
        srv.stop()
