"""Every capture the agent finishes goes through one upload path (auto-trigger included, its
reason kept), and a capture whose upload could not finish while its job lived is sent later,
exactly once: by ``aiprof upload`` or by the next agent started with the same server."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from srvsupport import PY, free_port, start_server

from aiprof.agent import outbox
from aiprof.server.auth import load_or_create_token
from aiprof.server.client import ServerError

SLOW = Path(__file__).resolve().parents[1] / "agent" / "scripts" / "slowdown_train.py"


def _run(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "aiprof", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _env(tmp_path: Path, token: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIPROF")}
    return dict(env, AIPROF_TOKEN=token, AIPROF_RUNTIME_DIR=str(tmp_path / "rt"))


def _wait_state(client, cid: str, state: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = client.get(f"captures/{cid}")
            if st.get("state") == state:
                return st
        except ServerError as exc:
            st = {"error": str(exc)}
        assert time.monotonic() < deadline, f"capture {cid} not {state}: {st}"
        time.sleep(0.3)


def _same_bytes(local: Path, stored: Path) -> list[str]:
    """The names of the local rank folder's files, each checked byte for byte against the server's copy."""
    names = sorted(p.name for p in local.iterdir() if p.is_file() and not p.name.startswith("."))
    for n in names:
        assert (stored / n).read_bytes() == (local / n).read_bytes(), n
    return names


def _offline_capture(tmp_path: Path, url: str, token: str) -> Path:
    """A job run with ``--server url`` while nothing listens there; returns its local rank folder."""
    out = tmp_path / "local"
    r = _run("run", "--server", url, "--job", "offline-job", "--out", str(out), "--capture-id", "off1",
             "--skip", "2", "--iterations", "2", "--", PY, str(SLOW), "--fast", "20", "--slow", "0",
             env=_env(tmp_path, token))
    assert r.returncode == 0, r.stderr[-3000:]
    d = out / "off1" / "rank0"
    assert (d / "meta.json").exists() and not (d / outbox.UPLOADED).exists(), r.stderr[-2000:]
    marker = json.loads((d / outbox.PENDING).read_text())  # the job ended with its upload pending, on disk
    assert marker["server"] == url and marker["capture_id"] == "off1" and marker["job"] == "offline-job"
    assert "not answering" in r.stderr
    return d


def test_pending_capture_is_delivered_once_by_aiprof_upload(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    token = load_or_create_token(str(data))
    d = _offline_capture(tmp_path, url, token)
    srv = start_server(data, port)
    try:
        env = _env(tmp_path, token)
        up = _run("upload", "--server", url, str(tmp_path / "local"), "--json", env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        (res,) = json.loads(up.stdout)["results"]
        assert res["ok"] and res["capture_id"] == "off1" and res["rank"] == 0
        c = srv.client()
        st = _wait_state(c, "off1", "analysed", 60)
        assert st["job"] == "offline-job" and st["received"] == [0] and st["source"] == "agent"
        names = _same_bytes(d, data / "captures" / "off1" / "rank0")
        assert "trace.json.gz" in names and "meta.json" in names
        stats = c.get("info")["stats"]
        assert stats["uploads"] == len(names)  # each file stored once
        assert stats["upload_bytes"] == sum((d / n).stat().st_size for n in names)
        assert not (d / outbox.PENDING).exists() and outbox.uploaded_to(str(d)) == url
        again = _run("upload", "--server", url, str(tmp_path / "local"), env=env)  # nothing left to send
        assert again.returncode == 0 and "nothing to upload" in again.stderr, again.stderr
        assert c.get("info")["stats"]["uploads"] == len(names)
    finally:
        srv.stop()


def test_next_run_with_the_same_server_delivers_what_an_earlier_job_left(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    token = load_or_create_token(str(data))
    d = _offline_capture(tmp_path, url, token)
    srv = start_server(data, port)
    try:
        # a later job on this host, same server and --out, captures nothing itself
        r = _run("run", "--server", url, "--job", "next-job", "--out", str(tmp_path / "local"), "--",
                 PY, str(SLOW), "--fast", "300", "--slow", "0", env=_env(tmp_path, token))
        assert r.returncode == 0, r.stderr[-3000:]
        c = srv.client()
        st = _wait_state(c, "off1", "analysed", 60)
        assert st["job"] == "offline-job" and st["received"] == [0]  # the job it was taken in
        names = _same_bytes(d, data / "captures" / "off1" / "rank0")
        assert c.get("info")["stats"]["uploads"] == len(names)
        assert not (d / outbox.PENDING).exists() and outbox.uploaded_to(str(d)) == url
    finally:
        srv.stop()


def test_auto_trigger_capture_is_uploaded_with_its_reason(server, tmp_path):
    out = tmp_path / "caps"
    auto = {"warmup_steps": 3, "baseline_steps": 10, "recent_steps": 3, "capture_iterations": 3, "gap_s": 60,
            "min_interval_s": 0.0, "max_captures": 1, "poll_s": 0.1}
    # the job stays slow (3x its own fast steps, whatever the load does to them) until the capture
    # it causes is written: no race between the slow phase's end and the agent's reaction
    r = _run("run", "--server", server.url, "--job", "auto-job", "--out", str(out), "--auto", json.dumps(auto),
             "--", PY, str(SLOW), "--fast", "30", "--slow", "5", "--slow-factor", "3",
             "--slow-until", str(out / "*" / "rank0" / "meta.json"), env=_env(tmp_path, server.token))
    assert r.returncode == 0, r.stderr[-3000:]
    (local,) = sorted(p.parent for p in out.glob("*/rank0/meta.json"))
    cid = local.parent.name
    c = server.client()
    st = _wait_state(c, cid, "analysed", 60)  # one rank decided alone: the server waits for no other
    assert st["expected"] is None and st["received"] == [0] and st["missing"] == []
    assert st["trigger"]["reason"] == "slowdown" and st["trigger"]["scope"] == "rank"
    listed = {x["capture_id"]: x for x in c.get("captures")["captures"]}
    assert listed[cid]["trigger"]["reason"] == "slowdown" and listed[cid]["job"] == "auto-job"
    _same_bytes(local, server.data / "captures" / cid / "rank0")
    assert outbox.uploaded_to(str(local)) == server.url and not (local / outbox.PENDING).exists()
