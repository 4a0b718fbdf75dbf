"""The service under hostile clients (issue 31, item 5), each on a real ``aiprof server``
process on a free loopback port: slowloris, the login redirect, a deeply nested JSON body,
fake registrations, a stalled upload; and ``aiprof ui``'s Host check. Latencies are printed
(run with -s); the assertions use generous bounds only."""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from srvsupport import start_server

from aiprof.server.client import ServerClient, ServerError
from aiprof.server.jsonapi import BODY_IDLE_TIMEOUT_S
from aiprof.server.netguard import HEADER_TIMEOUT_S
from aiprof.server.registry import MAX_AGENTS_PER_ADDRESS
from aiprof.server.upload_routes import LOCK_WAIT_S

from tests import procs

DATA = Path(__file__).parent.parent / "data"
ANSWER_S = 30.0  # generous bound on any answer the tests wait for


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def _log(srv) -> str:
    return "".join(p.read_text(errors="replace") for p in srv.data.parent.glob(f"{srv.data.name}-server-*.log"))


def _timed_health(url: str) -> float:
    t0 = time.monotonic()
    assert ServerClient(url, None, timeout=ANSWER_S).get("health")
    return time.monotonic() - t0


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (BlockingIOError, socket.timeout):
        return False


def test_slowloris_past_the_connection_cap_does_not_starve_a_normal_client(tmp_path):
    cap, n = 64, 300  # 300 half-sent requests against a cap of 64 connections
    srv = start_server(tmp_path / "data", 0, "--max-connections", str(cap))
    socks: list[socket.socket] = []
    try:
        host, port = _hostport(srv.url)
        base = _timed_health(srv.url)
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=ANSWER_S)
            s.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: localhost\r\nX-a: ")  # never finished
            socks.append(s)
        lat = [_timed_health(srv.url) for _ in range(5)]
        print(f"\nhealth: {base * 1e3:.1f} ms alone; with {n} half-sent requests (cap {cap}): "
              + ", ".join(f"{x * 1e3:.1f}" for x in lat) + " ms")
        # every half-sent request is closed: the oldest evicted by newer connections, the rest
        # at the header timeout
        t0 = time.monotonic()
        open_ = list(socks)
        while open_ and time.monotonic() - t0 < HEADER_TIMEOUT_S + ANSWER_S:
            for s in open_:
                s.setblocking(False)
            open_ = [s for s in open_ if not _closed_by_peer(s)]
            if open_:
                time.sleep(0.2)
        print(f"all {n} closed by the server {time.monotonic() - t0:.1f} s after the last was opened")
        assert not open_, f"{len(open_)} half-sent requests still open"
        assert srv.proc.poll() is None and _timed_health(srv.url) < ANSWER_S
    finally:
        for s in socks:
            s.close()
        srv.stop()
    assert "Traceback" not in _log(srv)


def test_drip_fed_headers_are_cut_at_the_header_timeout(server):
    host, port = _hostport(server.url)
    with socket.create_connection((host, port), timeout=ANSWER_S) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
        closed = False
        while time.monotonic() - t0 < HEADER_TIMEOUT_S + ANSWER_S:  # one header byte a second
            try:
                s.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            s.settimeout(1.0)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            except ConnectionResetError:
                closed = True
                break
        took = time.monotonic() - t0
    print(f"\ndrip-fed request closed after {took:.1f} s (HEADER_TIMEOUT_S {HEADER_TIMEOUT_S:g})")
    assert closed and took >= HEADER_TIMEOUT_S - 1


def test_login_redirects_only_to_a_local_path(server):
    host, port = _hostport(server.url)
    for path, want in ((f"//evil.example/?token={server.token}", "/evil.example/"),
                       (f"///evil.example/x?token={server.token}&a=1", "/evil.example/x?a=1"),
                       (f"/\\evil.example/?token={server.token}", "/%5Cevil.example/"),
                       (f"/captures/?token={server.token}", "/captures/")):
        c = http.client.HTTPConnection(host, port, timeout=ANSWER_S)
        try:
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            assert r.status == 303 and r.getheader("location") == want, (path, r.status, r.getheader("location"))
        finally:
            c.close()


def test_deeply_nested_json_is_400_not_500(server):
    host, port = _hostport(server.url)
    c = http.client.HTTPConnection(host, port, timeout=ANSWER_S)
    try:
        c.request("POST", "/api/v1/agents", body=b"[" * (1 << 20),
                  headers={"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"})
        r = c.getresponse()
        body = r.read()
    finally:
        c.close()
    assert r.status == 400 and b"nests too deeply" in body, (r.status, body)
    assert "RecursionError" not in _log(server) and "Traceback" not in _log(server)


def test_registrations_are_bounded_per_address(server):
    c = server.client()
    real = c.post("agents", {"agent_id": "real-1", "job": "job", "host": "h", "pid": 1})
    base = real["interval_s"]
    refused = ok = 0
    for i in range(MAX_AGENTS_PER_ADDRESS + 100):
        try:
            c.post("agents", {"agent_id": f"fake-{i}", "job": f"fake{i % 7}", "host": f"h{i}", "pid": i})
            ok += 1
        except ServerError as exc:
            assert exc.status == 429 and "--max-agents-per-host" in str(exc), exc
            refused += 1
    assert ok == MAX_AGENTS_PER_ADDRESS - 1 and refused == 101
    # the real agent keeps its heartbeat period and can still re-register
    assert c.post("agents/real-1/heartbeat", {"steps": 1})["interval_s"] == base
    assert c.post("agents", {"agent_id": "real-1", "job": "job", "host": "h", "pid": 1})["interval_s"] == base


def test_a_stalled_upload_does_not_hold_the_file(server, tmp_path):
    src = tmp_path / "trace.json.gz"
    src.write_bytes(os.urandom(1 << 20))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    size = src.stat().st_size
    host, port = _hostport(server.url)
    path = ServerClient.file_path("stall", 0, "trace.json.gz") + f"?offset=0&size={size}&sha256={digest}&job=j"
    stalled = socket.create_connection((host, port), timeout=ANSWER_S + BODY_IDLE_TIMEOUT_S)
    try:
        stalled.sendall(f"PUT {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {server.token}\r\n"
                        f"Content-Length: {size}\r\n\r\n".encode() + src.read_bytes()[: size // 2])
        # it holds the file's lock once its bytes reach the part file (bounded poll of the disk)
        part = server.data / "captures" / "stall" / "rank0" / ".uploads" / "trace.json.gz.part"
        deadline = time.monotonic() + ANSWER_S
        while not (part.exists() and part.stat().st_size > 0):
            assert time.monotonic() < deadline, "the stalled upload never started"
            time.sleep(0.05)
        c = server.client(timeout=ANSWER_S + LOCK_WAIT_S)
        t0 = time.monotonic()
        res = c.upload_file("stall", 0, str(src), job="j", timeout=ANSWER_S + LOCK_WAIT_S)
        took = time.monotonic() - t0
        print(f"\nsecond client's upload done {took:.1f} s after it began (body idle timeout "
              f"{BODY_IDLE_TIMEOUT_S:g} s, lock wait {LOCK_WAIT_S:g} s), resumed at {res.resumed_from} bytes")
        assert took < LOCK_WAIT_S + ANSWER_S
        stalled.settimeout(ANSWER_S)
        answer = stalled.recv(4096)
        assert b" 408 " in answer.split(b"\r\n", 1)[0], answer[:200]
    finally:
        stalled.close()
    got = server.data / "captures" / "stall" / "rank0" / "trace.json.gz"
    assert got.read_bytes() == src.read_bytes()


def test_binding_every_interface_is_warned(tmp_path):
    srv = start_server(tmp_path / "data", 0, "--host", "0.0.0.0")
    try:
        assert _timed_health(srv.url) < ANSWER_S
    finally:
        srv.stop()
    lines = [ln for ln in _log(srv).splitlines() if "warning" in ln]
    assert len(lines) == 1 and "--host 0.0.0.0 listens on every network interface" in lines[0], lines


@pytest.fixture
def ui_url(tmp_path):
    trace = tmp_path / "t.json.gz"
    trace.write_bytes((DATA / "ddp4_slow2_rank0.json.gz").read_bytes())
    p = subprocess.Popen([sys.executable, "-m", "aiprof", "ui", str(trace), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    try:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.extend(iter(p.stdout.readline, "")), daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while url is None:
            assert p.poll() is None and time.monotonic() < deadline, "".join(box)
            for ln in box:
                if "serving" in ln:
                    url = ln.split(" on ", 1)[1].split()[0].rstrip("/")
            time.sleep(0.05)
        yield url
    finally:
        procs.stop(p)


def test_ui_answers_only_to_local_host_names(ui_url):
    host, port = _hostport(ui_url)
    for name, want in ((f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200), (f"[::1]:{port}", 200),
                       ("localhost", 200), (f"evil.example:{port}", 421), ("evil.example", 421),
                       (f"127.0.0.1.evil.example:{port}", 421), ("", 421)):
        c = http.client.HTTPConnection(host, port, timeout=ANSWER_S)
        try:
            c.putrequest("GET", "/api/meta", skip_host=True)
            c.putheader("Host", name)
            c.endheaders()
            r = c.getresponse()
            r.read()
            assert r.status == want, (name, r.status)
        finally:
            c.close()


def test_the_server_answers_while_an_analysis_runs(server, tmp_path):
    """Analysis runs in a child process: the event loop keeps answering while it works."""
    import json

    rank = tmp_path / "rank0"
    rank.mkdir()
    (rank / "trace.json.gz").write_bytes((DATA / "ddp2_slow1_rank0.json.gz").read_bytes())
    (rank / "meta.json").write_text(json.dumps({"schema": "aiprof.capture/1", "capture_id": "big", "world_size": 1}))
    c = server.client()
    for name in ("trace.json.gz", "meta.json"):  # meta.json last: it completes the rank
        c.upload_file("big", 0, str(rank / name), job="j", world_size=1)
    during: list[float] = []
    deadline = time.monotonic() + 300
    while True:
        st = c.get("captures/big")
        state = st.get("state") or (st.get("capture") or {}).get("state")
        if state not in ("capturing", "uploaded", "analysing"):
            break
        assert time.monotonic() < deadline, "the analysis did not end"
        if state == "analysing":
            t0 = time.monotonic()
            c.get("captures")
            during.append(time.monotonic() - t0 + _timed_health(server.url))
        else:
            time.sleep(0.1)
    print(f"\n{len(during)} answers while analysing, slowest {max(during, default=0) * 1e3:.1f} ms, "
          f"median {sorted(during)[len(during) // 2] * 1e3 if during else 0:.1f} ms; final state {state}")
    assert state == "analysed" and during and max(during) < ANSWER_S


def test_a_flood_of_bad_requests_is_a_few_log_lines(server):
    host, port = _hostport(server.url)
    for _ in range(200):  # each is "Invalid HTTP request received." in uvicorn's log
        with socket.create_connection((host, port), timeout=ANSWER_S) as s:
            s.sendall(b"\x00\x01 not http\r\n\r\n")
            while s.recv(4096):
                pass
    assert _timed_health(server.url) < ANSWER_S
    log = _log(server)
    print(f"\n200 bad requests: {log.count('Invalid HTTP request')} log lines, {len(log)} bytes of log")
    assert 1 <= log.count("Invalid HTTP request") <= 10, log[-2000:]
