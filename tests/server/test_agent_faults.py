"""The job is never hurt and nothing is lost when the service fails the agent: down at the
start, killed in the middle of the run, refusing the token. Real processes: ``aiprof server``
on 127.0.0.1, ``aiprof run`` with the CPU example's model and step (tests/agent/scripts/
gated_train.py, which prints every step and waits at gates the test opens)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from srvsupport import PY, free_port, start_server

from aiprof.agent import outbox
from aiprof.server.auth import load_or_create_token

GATED = Path(__file__).resolve().parents[1] / "agent" / "scripts" / "gated_train.py"


def _env(tmp_path: Path, token: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIPROF")}
    return dict(env, AIPROF_TOKEN=token, AIPROF_RUNTIME_DIR=str(tmp_path / "rt"))


def _job(url: str, out: Path, *gates: str, steps: int = 10) -> list[str]:
    """``aiprof run --server URL`` of a job that captures iterations 3 and 4 by itself."""
    return [PY, "-m", "aiprof", "run", "--server", url, "--job", "fault-job", "--out", str(out), "--capture-id", "c",
            "--skip", "3", "--iterations", "2", "--", PY, str(GATED), "--steps", str(steps),
            *[x for g in gates for x in ("--gate", g)]]


def _finished(rc: int, stdout: str, stderr: str, steps: int) -> None:
    """Exit code 0, every step once in order, the end reached, no traceback."""
    assert rc == 0, stderr[-3000:]
    assert [int(m) for m in re.findall(r"^step (\d+) [0-9.]+ ms$", stdout, re.M)] == list(range(steps))
    assert f"done {steps} steps" in stdout and "Traceback" not in stderr, stderr[-3000:]


def _pending(d: Path, url: str) -> None:
    """A whole capture, marked for upload to ``url``, not uploaded."""
    assert (d / "meta.json").exists() and (d / "trace.json.gz").exists()
    assert json.loads((d / outbox.PENDING).read_text())["server"] == url
    assert not (d / outbox.UPLOADED).exists() and not (d / outbox.REFUSED).exists()


def _upload(url: str, token: str, tmp_path: Path, out: Path) -> dict:
    up = subprocess.run([PY, "-m", "aiprof", "upload", "--server", url, str(out), "--json"], capture_output=True,
                        text=True, timeout=120, env=_env(tmp_path, token), check=False)
    assert up.returncode == 0, up.stdout + up.stderr
    (res,) = json.loads(up.stdout)["results"]
    return res


def _same_files(local: Path, stored: Path) -> None:
    for p in local.iterdir():
        if p.is_file() and not p.name.startswith("."):
            assert (stored / p.name).read_bytes() == p.read_bytes(), p.name


def test_server_down_at_start(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    token = load_or_create_token(str(data))
    out = tmp_path / "caps"
    r = subprocess.run(_job(url, out), capture_output=True, text=True, timeout=180, env=_env(tmp_path, token),
                       check=False)
    _finished(r.returncode, r.stdout, r.stderr, 10)
    assert "not answering" in r.stderr
    _pending(out / "c" / "rank0", url)
    srv = start_server(data, port)  # the server comes up later: aiprof upload delivers what waited
    try:
        res = _upload(url, token, tmp_path, out)
        assert res["ok"] and res["capture_id"] == "c"
        _same_files(out / "c" / "rank0", data / "captures" / "c" / "rank0")
    finally:
        srv.stop()


def test_server_killed_in_the_middle_of_the_run(tmp_path):
    data = tmp_path / "data"
    srv = start_server(data)
    url, token = srv.url, srv.token
    port = int(url.rsplit(":", 1)[1])
    out = tmp_path / "caps"
    gate = tmp_path / "gate"
    job = subprocess.Popen(_job(url, out, f"2:{gate}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_env(tmp_path, token))
    try:
        deadline = time.monotonic() + 90
        while not srv.client().get("jobs")["jobs"].get("fault-job"):  # registered, then held before step 2
            assert time.monotonic() < deadline and job.poll() is None, "the agent never registered"
            time.sleep(0.1)
        srv.proc.kill()  # the server dies: the job captures after this, with nobody to upload to
        srv.proc.wait(10)
        gate.write_text("")
        stdout, stderr = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
        srv.stop()
    _finished(job.returncode, stdout, stderr, 10)
    _pending(out / "c" / "rank0", url)
    srv2 = start_server(data, port)
    try:
        res = _upload(url, token, tmp_path, out)
        assert res["ok"] and res["files"] >= 2
        _same_files(out / "c" / "rank0", data / "captures" / "c" / "rank0")
    finally:
        srv2.stop()


def test_wrong_token(server, tmp_path):
    out = tmp_path / "caps"
    r = subprocess.run(_job(server.url, out), capture_output=True, text=True, timeout=180,
                       env=_env(tmp_path, "not-the-token"), check=False)
    _finished(r.returncode, r.stdout, r.stderr, 10)
    assert "refuses this agent's token" in r.stderr
    assert server.client().get("jobs")["jobs"] == {}  # nothing got in
    _pending(out / "c" / "rank0", server.url)  # kept for a retry with the right token
    res = _upload(server.url, server.token, tmp_path, out)
    assert res["ok"]
    _same_files(out / "c" / "rank0", server.data / "captures" / "c" / "rank0")
