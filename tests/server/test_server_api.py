"""The service's API over real HTTP: token, name sanitising, size limits, checksums, resumable
and concurrent uploads, restart without loss, job-wide planning."""
from __future__ import annotations

import hashlib
import http.client
import math
import os
import stat
import threading
import time

import pytest
from srvsupport import start_server

from aiprof.server.client import UPLOAD_BLOCK, ServerError, file_sha256
from aiprof.server.registry import AgentInfo, plan_start
from aiprof.protocol import PM_PREWARM_LEAD_S, PM_SETUP_LEAD_S
from aiprof.server.store import BadName, DataDir, safe_name


def _raw(server, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, bytes]:
    host, port = server.url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_token_is_created_0600_and_required(server):
    mode = stat.S_IMODE(os.stat(server.data / "token").st_mode)
    assert mode == 0o600 and len(server.token) >= 40
    for method, path in [("GET", "/api/v1/jobs"), ("GET", "/api/v1/captures"), ("POST", "/api/v1/agents"),
                         ("POST", "/api/v1/jobs/j/captures"), ("POST", "/api/v1/jobs/j/hang"), ("GET", "/"),
                         ("PUT", "/api/v1/captures/c/ranks/0/files/f?size=1&offset=0&sha256=" + "0" * 64),
                         ("GET", "/captures/c/api/meta"), ("GET", "/api/v1/info")]:
        for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "aiprof_token=wrong"}):
            status, _ = _raw(server, method, path, b"x" if method != "GET" else b"", hdr)
            assert status == 401, (method, path, hdr, status)
    # the API never takes the cookie (it changes state): no cross-site triggers from a logged-in browser
    assert _raw(server, "GET", "/api/v1/jobs", headers={"Cookie": f"aiprof_token={server.token}"})[0] == 401
    assert _raw(server, "GET", "/", headers={"Cookie": f"aiprof_token={server.token}"})[0] == 200
    assert server.client().get("jobs") == {"jobs": {}, "interval_s": 1.0}
    assert not (server.data / "captures" / "c").exists()


def test_browser_login_sets_cookie_and_drops_token_from_url(server):
    status, _ = _raw(server, "GET", f"/?token={server.token}")
    assert status == 303
    host, port = server.url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", f"/?a=1&token={server.token}")
    r = c.getresponse()
    assert r.getheader("location") == "/?a=1"
    assert f"aiprof_token={server.token}" in r.getheader("set-cookie") and "HttpOnly" in r.getheader("set-cookie")


@pytest.mark.parametrize("name", ["..", "../x", "a/../../token", ".hidden", "", "x" * 200, "a b", "a\\b", "ok/..",
                                  "trace.json.gz/../../../token"])
def test_safe_name_rejects(name):
    with pytest.raises(BadName):
        safe_name(name)


def test_upload_path_traversal_is_refused_and_writes_nothing(server, tmp_path):
    before = sorted(p for p in server.data.rglob("*"))
    sha = hashlib.sha256(b"x").hexdigest()
    auth = {"Authorization": f"Bearer {server.token}"}
    for cid, rank, name in [("..", "0", "f"), ("%2e%2e", "0", "token"), ("c", "0", "%2e%2e"), ("c", "0", "..%2Ftoken"),
                            ("c", "0", "..%2F..%2F..%2Ftoken"), ("c", "-1", "f"), ("c", "0x1", "f"), ("c", "0", ".uploads"),
                            ("c%2F..%2F..", "0", "token"), ("c", "0", "a%00b")]:
        status, body = _raw(server, "PUT", f"/api/v1/captures/{cid}/ranks/{rank}/files/{name}?offset=0&size=1&sha256={sha}",
                            b"x", auth)
        assert 400 <= status < 500, (cid, rank, name, status, body)
    assert (server.data / "token").read_text().strip() == server.token  # not overwritten
    assert sorted(p for p in server.data.rglob("*")) == before
    d = DataDir(str(tmp_path / "d"))
    with pytest.raises(BadName):
        d.file_path("c", 0, "../../x")


def test_upload_checksum_size_limits_and_resume(tmp_path):
    srv = start_server(tmp_path / "data", 0, "--max-file-mb", "1")
    try:
        c = srv.client()
        f = tmp_path / "trace.json.gz"
        f.write_bytes(os.urandom(600_000))
        digest, size = file_sha256(str(f))
        # a wrong checksum: refused, nothing kept
        with pytest.raises(ServerError) as e:
            c.request("PUT", c.file_path("cap1", 0, "trace.json.gz"), raw=f.read_bytes(),
                      query={"offset": 0, "size": size, "sha256": "0" * 64})
        assert e.value.status == 422
        assert c.get(c.file_path("cap1", 0, "trace.json.gz")) == {"complete": False, "received": 0}
        # over the size limit (1 MiB): 413, before any byte is stored
        with pytest.raises(ServerError) as e:
            c.request("PUT", c.file_path("cap1", 0, "big"), raw=b"x", query={"offset": 0, "size": 2 << 20, "sha256": digest})
        assert e.value.status == 413
        # more bytes than declared: 413
        with pytest.raises(ServerError) as e:
            c.request("PUT", c.file_path("cap1", 0, "short"), raw=b"xyz", query={"offset": 0, "size": 2, "sha256": digest})
        assert e.value.status == 413
        # a connection that stopped half way: the server keeps 250000 bytes; the client resumes there
        half = 250_000
        r = c.request("PUT", c.file_path("cap1", 0, "trace.json.gz"), raw=f.read_bytes()[:half],
                      query={"offset": 0, "size": size, "sha256": digest})
        assert r == {"complete": False, "received": half}
        with pytest.raises(ServerError) as e:  # a wrong offset is answered with what the server holds
            c.request("PUT", c.file_path("cap1", 0, "trace.json.gz"), raw=b"x", query={"offset": 5, "size": size, "sha256": digest})
        assert e.value.status == 409 and e.value.body["received"] == half
        res = c.upload_file("cap1", 0, str(f))
        assert (res.resumed_from, res.sent, res.sha256) == (half, size - half, digest)
        stored = srv.data / "captures" / "cap1" / "rank0" / "trace.json.gz"
        assert stored.read_bytes() == f.read_bytes()
        # uploading again stores nothing new (a file of one block goes in one PUT, without asking
        # first: the server answers that it has it); a different file under the same name is refused
        st = stored.stat()
        again = c.upload_file("cap1", 0, str(f))
        assert size <= UPLOAD_BLOCK and (again.attempts, again.sent, again.resumed_from) == (1, size, 0)
        # the server kept the file it had: not rewritten (same inode, same modification time)
        assert (stored.stat().st_ino, stored.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
        f2 = tmp_path / "other"
        f2.write_bytes(b"other")
        with pytest.raises(ServerError) as e:
            c.upload_file("cap1", 0, str(f2), name="trace.json.gz", attempts=1)
        assert e.value.status == 409
    finally:
        srv.stop()


def test_concurrent_uploads_lose_nothing_and_survive_restart(tmp_path):
    data = tmp_path / "data"
    srv = start_server(data)
    ranks = 32
    files = {}
    for r in range(ranks):
        p = tmp_path / f"r{r}.bin"
        p.write_bytes(os.urandom(50_000 + 997 * r))
        files[r] = p
    errors: list[str] = []
    c = srv.client(timeout=30)

    def one(r: int) -> None:
        try:
            c.upload_file("many", r, str(files[r]), "trace.json.gz", job="jobA")
            c.upload_file("many", r, str(files[r]), "meta.json", job="jobA")
        except Exception as exc:  # collected: the assertion below names them
            errors.append(f"{r}: {exc}")

    threads = [threading.Thread(target=one, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    st = c.get("captures/many")
    assert st["job"] == "jobA" and sorted(map(int, st["files"])) == list(range(ranks))
    srv.stop()
    srv2 = start_server(data)  # restart on the same folder: same token, same captures, same bytes
    try:
        assert srv2.token == srv.token
        st2 = srv2.client().get("captures/many")
        assert st2["files"] == st["files"]
        for r in range(ranks):
            got = (data / "captures" / "many" / f"rank{r}" / "trace.json.gz").read_bytes()
            assert hashlib.sha256(got).digest() == hashlib.sha256(files[r].read_bytes()).digest()
        assert any(x["capture_id"] == "many" for x in srv2.client().get("captures")["captures"])
        # an agent that registered with the old server is told to register again
        with pytest.raises(ServerError) as e:
            srv2.client().post("agents/someone-1/heartbeat", {"steps": 3})
        assert e.value.status == 404
    finally:
        srv2.stop()


def test_trigger_needs_live_agents_and_plans_one_start(server):
    c = server.client()
    with pytest.raises(ServerError) as e:
        c.post("jobs/nojob/captures", {"request": {"iterations": 2}})
    assert e.value.status == 404 and "nojob" in str(e.value)
    t0 = time.monotonic()
    for r, steps in ((0, 100), (1, 98)):  # CPU agents: no PM sampler to leave room for
        c.post("agents", {"agent_id": f"h-{r}", "job": "j1", "host": "h", "pid": 10 + r, "rank": r, "world_size": 2,
                          "steps": steps, "step_ms": 50.0, "pm_off": True})
    started = c.post("jobs/j1/captures", {"request": {"iterations": 2, "skip": 0}, "auto_analyze": False})
    # heartbeat 1 s + 0.75 s margin at 50 ms/step = 35 iterations (+1) past the highest count, which
    # the server extrapolates by one iteration per 50 ms since the heartbeat
    late = int((time.monotonic() - t0) / 0.05) + 1
    assert started["ranks"] == [0, 1] and 136 <= started["start_at"] <= 137 + late
    for r in (0, 1):
        cmds = c.post(f"agents/h-{r}/heartbeat", {"steps": 101})["commands"]
        assert [(x["op"], x["capture_id"], x["request"]["start_at"], x["request"]["iterations"]) for x in cmds] == \
            [("capture", started["capture_id"], started["start_at"], 2)]
    assert c.post("agents/h-0/heartbeat", {"steps": 102})["commands"] == []  # taken once
    # a rank reporting failure completes the capture as failed once no rank arrives
    for r in (0, 1):
        c.post("agents/h-0/results", {"capture_id": started["capture_id"], "rank": r, "ok": False, "error": "busy"})
    deadline = time.monotonic() + 10
    while c.get(f"captures/{started['capture_id']}")["state"] == "capturing":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert c.get(f"captures/{started['capture_id']}")["state"] == "failed"


def test_a_capture_with_pm_counters_gets_room_for_the_sampler(server):
    """Agents report whether their PM sampler is loaded (``pm_ready``): the common start leaves
    its set-up, and its loading while any rank has not loaded it (protocol.pm_lead_s)."""
    c = server.client()
    pm = {"iterations": 2, "skip": 0, "what": "kernels,hw", "hw_pm_interval_us": 100}
    # "po": agents that will not sample (CPU jobs report pm_off): no room at all
    for job, ready, off, lead_s in (("pr", True, False, PM_SETUP_LEAD_S),
                                    ("pn", False, False, PM_SETUP_LEAD_S + PM_PREWARM_LEAD_S), ("po", False, True, 0.0)):
        t0 = time.monotonic()
        for r in (0, 1):
            c.post("agents", {"agent_id": f"{job}-{r}", "job": job, "host": "h", "pid": 20 + r, "rank": r,
                              "world_size": 2, "steps": 100, "step_ms": 50.0, "pm_ready": ready, "pm_off": off})
        started = c.post(f"jobs/{job}/captures", {"request": pm, "auto_analyze": False})
        late = int((time.monotonic() - t0) / 0.05) + 1  # iterations the server extrapolates since the heartbeat
        # heartbeat 1 s + 0.75 s + the lead, at 50 ms an iteration (+1), past the count of 100
        margin = math.ceil((1.0 + 0.75 + lead_s) * 1e3 / 50.0) + 1
        assert 100 + margin <= started["start_at"] <= 101 + margin + late, (job, started["start_at"], margin, late)


def test_plan_start_uses_the_freshest_estimate():
    now = 1000.0
    a = AgentInfo("a", "j", "h", 1, 0, 2, {}, last_seen=now - 0.5, steps=100, step_ms=10.0)
    b = AgentInfo("b", "j", "h", 2, 1, 2, {}, last_seen=now, steps=150, step_ms=10.0)
    # a: 100 + 50 (0.5 s at 10 ms) = 150; b: 150; margin = (1 + 0.75) s / 10 ms + 1 = 176
    assert plan_start([a, b], skip=0, interval_s=1.0, now=now) == 150 + 176
    assert plan_start([a, b], skip=500, interval_s=1.0, now=now) == 650
    idle = AgentInfo("c", "j", "h", 3, 0, 1, {}, steps=0)
    assert plan_start([idle], 0, 1.0) is None
    # a capture with PM counters: the sampler's set-up (protocol.PM_SETUP_LEAD_S) on top
    assert plan_start([a, b], skip=0, interval_s=1.0, now=now, lead_s=PM_SETUP_LEAD_S) == \
        150 + 176 + int(PM_SETUP_LEAD_S * 1e3 / 10.0)


def test_duration_trigger_gets_a_common_start_time(server):
    c = server.client()
    for r in (0, 1):
        c.post("agents", {"agent_id": f"d-{r}", "job": "jd", "host": "h", "pid": r, "rank": r, "world_size": 2,
                          "steps": 5, "step_ms": 20.0})
    t0 = time.time_ns()
    started = c.post("jobs/jd/captures", {"request": {"duration_ms": 500}, "auto_analyze": False})
    t1 = time.time_ns()
    # one heartbeat interval (1 s) + 0.75 s margin ahead of the request, the same instant for every rank
    assert started["start_at"] is None and t0 + 1.75e9 <= started["start_unix_ns"] <= t1 + 1.75e9
    got = [c.post(f"agents/d-{r}/heartbeat", {"steps": 6})["commands"][0] for r in (0, 1)]
    assert {x["start_unix_ns"] for x in got} == {started["start_unix_ns"]}
    assert all(x["request"]["duration_ms"] == 500 and x["request"]["start_at"] is None for x in got)
