"""The agent when its server is gone: the job runs on, its capture stays local, and is uploaded
once a server answers on that address."""
from __future__ import annotations

import os
import subprocess
import time

from srvsupport import PY, SCRIPTS, free_port, kill_group, start_server

from aiprof.agent.uplink import job_identity


def test_job_identity_from_launchers():
    assert job_identity({"AIPROF_JOB": "my job/1"}) == ("my-job-1", "AIPROF_JOB")
    assert job_identity({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7"})[0] == "torchrun-abc"
    assert job_identity({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})[0] == "slurm-7.0"
    assert job_identity({"JOBSET_NAME": "llm", "MASTER_PORT": "1"})[0] == "k8s-llm"
    assert job_identity({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})[0] == "master-10.0.0.1-29500"
    assert job_identity({})[1] == "process"


def test_server_down_job_continues_capture_uploaded_when_server_returns(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    from aiprof.server.auth import load_or_create_token

    token = load_or_create_token(str(data))  # the server that will come up later uses this token
    out = tmp_path / "local"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               AIPROF_TOKEN=token)
    t0 = time.monotonic()
    job = subprocess.Popen([PY, "-m", "aiprof", "run", "--server", url, "--job", "lost", "--out", str(out),
                            "--capture-id", "offline", "--skip", "3", "--iterations", "2",
                            "--", PY, str(SCRIPTS / "gloo_train.py"), "--seconds", "40",
                            "--stop-file", str(tmp_path / "stop")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    srv = None
    try:
        meta = out / "offline" / "rank0" / "meta.json"
        while not meta.exists():  # the capture is written locally although no server answers
            assert job.poll() is None and time.monotonic() - t0 < 40, job.stdout.read().decode()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        assert job.poll() is None  # the job keeps training
        srv = start_server(data, port)
        c = srv.client()
        deadline = time.monotonic() + 45
        while True:
            caps = {x["capture_id"]: x for x in c.get("captures")["captures"]}
            if caps.get("offline", {}).get("state") == "analysed":
                break
            assert time.monotonic() < deadline, f"capture not uploaded: {caps}"
            time.sleep(0.3)
        st = c.get("captures/offline")
        assert st["job"] == "lost" and st["received"] == [0] and st["source"] == "agent"
        local = (out / "offline" / "rank0" / "trace.json.gz").read_bytes()
        assert (data / "captures" / "offline" / "rank0" / "trace.json.gz").read_bytes() == local
        while "lost" not in c.get("jobs")["jobs"]:  # heartbeats back off to 10 s apart while the server is away
            assert time.monotonic() < deadline + 15, "the agent did not register with the returned server"
            time.sleep(0.3)
        assert c.get("jobs")["jobs"]["lost"][0]["rank"] == 0
        (tmp_path / "stop").touch()
        rc = job.wait(60)
        text = job.stdout.read().decode()
        assert rc == 0, text[-3000:]
        assert "not answering" in text  # said once, on stderr, and went on
    finally:
        kill_group(job)
        if srv:
            srv.stop()
