"""End to end on CPU: aiprof server + a 2-rank gloo job under ``aiprof run --server`` (torchrun),
one ``aiprof trigger --server --job``: both ranks record the same iterations, upload, the server
analyses, the web UI shows the capture (headless Chromium); then ``--hang`` over the same job."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
from srvsupport import PY, SCRIPTS, kill_group, start_server
from ui.conftest import open_page

JOB = "e2e"


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    srv = start_server(tmp / "data")
    stop = tmp / "stop"
    env_cmd = [PY, "-m", "aiprof", "run", "--server", srv.url, "--token", srv.token, "--job", JOB, "--out", str(tmp / "local"),
               "--", PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "gloo_train.py"), "--seconds", "90", "--stop-file", str(stop)]
    log = open(tmp / "job.log", "wb")
    job = subprocess.Popen(env_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        c = srv.client()
        deadline = time.monotonic() + 60
        while True:  # both ranks registered and stepping
            agents = c.get("jobs")["jobs"].get(JOB, [])
            if len(agents) == 2 and all(a["steps"] >= 5 for a in agents):
                break
            assert job.poll() is None, (tmp / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"ranks did not register: {agents}"
            time.sleep(0.2)
        yield srv, job, tmp
    finally:
        stop.touch()
        try:
            job.wait(20)
        except subprocess.TimeoutExpired:
            kill_group(job)
        log.close()
        srv.stop()


def _cli(srv, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "aiprof", "trigger", "--server", srv.url, "--token", srv.token, *args],
                          capture_output=True, text=True, timeout=timeout)


def test_job_wide_trigger_captures_same_iterations_analyses_and_shows_ui(live_job, page):
    srv, job, tmp = live_job
    listed = _cli(srv, "--list")
    assert listed.returncode == 0 and f"job {JOB}: 2 rank(s)" in listed.stdout
    r = _cli(srv, "--job", JOB, "--iterations", "3", "--auto-analyze", "--timeout", "90")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "analysed; ranks received 0, 1" in r.stdout
    url = r.stdout.strip().splitlines()[-1].removeprefix("report: ")
    cid = url.rstrip("/").rsplit("/", 1)[1]
    st = srv.client().get(f"captures/{cid}")
    assert st["state"] == "analysed" and st["received"] == [0, 1] and st["missing"] == []
    # the agreed iterations: every rank recorded start_at .. start_at+2
    assert st["aligned"] is True
    assert st["steps_by_rank"] == {"0": [st["start_at"] + i for i in range(3)], "1": [st["start_at"] + i for i in range(3)]}
    rep = srv.client().get(f"captures/{cid}/report")
    assert rep["capture"]["ranks_found"] == [0, 1]
    assert [s["step"] for s in rep["ranks"][0]["steps"]] == st["steps_by_rank"]["0"]
    # the bytes on the server are the agents' local files (checksums verified on upload)
    for rank in (0, 1):
        local = tmp / "local" / cid / f"rank{rank}" / "trace.json.gz"
        assert (srv.data / "captures" / cid / f"rank{rank}" / "trace.json.gz").read_bytes() == local.read_bytes()
    # the web UI: log in once, the index lists the capture, its UI shows both ranks and the report's numbers
    page.goto(f"{srv.url}/?token={srv.token}")
    assert cid in page.inner_text("#captures") and "analysed" in page.inner_text("#captures")
    page.click(f"a[href='captures/{cid}/']")
    open_page(page, f"{srv.url}/captures/{cid}/", "overview")
    assert page.eval_on_selector_all("#rank option", "els => els.map(e => e.value)") == ["0", "1"]
    open_page(page, f"{srv.url}/captures/{cid}/", "steps")
    text = page.inner_text("#page")
    for s in st["steps_by_rank"]["0"]:
        assert str(s) in text
    meta = json.loads(page.evaluate("async () => JSON.stringify(await (await fetch('api/meta')).json())"))
    assert meta["world_size"] == 2 and [rk["steps"] for rk in meta["ranks"]] == [st["steps_by_rank"]["0"]] * 2


def test_hang_snapshot_of_every_rank(live_job):
    srv, job, tmp = live_job
    r = _cli(srv, "--job", JOB, "--hang", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["result"]
    assert sorted(p["rank"] for p in res["processes"]) == [0, 1]
    assert res["missing_ranks"] == [] and sum(g["size"] for g in res["groups"]) == 2
    # the stacks are the job's own: its training loop shows in every rank's main thread
    assert all("gloo_train.py" in " ".join(g["stack"]) for g in res["groups"])
    assert job.poll() is None  # snapshots do not disturb the job


def test_trigger_without_a_live_job_is_one_line(live_job):
    srv, _, _ = live_job
    r = _cli(srv, "--job", "nosuchjob", "--iterations", "2", timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nosuchjob" in r.stderr and JOB in r.stderr
    r = subprocess.run([PY, "-m", "aiprof", "trigger", "--server", srv.url, "--token", "bad", "--list"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "HTTP 401" in r.stderr
