"""``aiprof attach --server``: an agent injected into a running CPU training loop registers with
the central service, and a job-wide ``aiprof trigger --server --job`` capture from it arrives,
byte for byte, and is analysed."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from capsupport import aiprof, stop, wait_for
from test_attach import injection_ok, tiny_target  # noqa: F401  (fixtures)

from tests.deps import need

need("uvicorn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from srvsupport import start_server  # noqa: E402

JOB = "attached-job"


def test_attach_with_server_registers_and_a_server_trigger_is_uploaded_and_analysed(injection_ok, tiny_target, rt,
                                                                                     tmp_path):
    proc, _ = tiny_target
    srv = start_server(tmp_path / "data")
    try:
        out = tmp_path / "caps"
        auth = ["--server", srv.url, f"--token={srv.token}"]
        res = aiprof(rt, "attach", str(proc.pid), "--no-capture", "--job", JOB, "--out", str(out), *auth, timeout=90)
        assert res.returncode == 0 and "agent started via" in res.stderr, res.stderr
        c = srv.client()

        def registered() -> list | None:
            agents = c.get("jobs")["jobs"].get(JOB)
            return agents if agents and agents[0].get("steps", 0) > 0 else None
        (agent,) = wait_for(registered, 30, f"the attached agent's registration under {JOB} with steps")
        assert agent["pid"] == proc.pid and agent["rank"] == 0 and agent["origin"] == "attach"
        t0 = time.monotonic()
        trig = aiprof(rt, "trigger", *auth, "--job", JOB, "--iterations", "2", "--auto-analyze", "--json",
                      "--timeout", "60", timeout=120)
        took = time.monotonic() - t0
        assert trig.returncode == 0, trig.stdout + trig.stderr
        st = json.loads(trig.stdout)
        cid = st["capture_id"]
        assert st["state"] == "analysed" and st["received"] == [0] and st["aligned"] is True, st
        assert st["trigger"]["reason"] == "server"
        start = st["start_at"]
        # two consecutive iterations from the server's start on (later when the command arrived after it)
        first = st["steps_by_rank"]["0"][0]
        assert st["steps_by_rank"]["0"] == [first, first + 1] and first >= start
        local = out / cid / "rank0"
        stored = srv.data / "captures" / cid / "rank0"
        for name in ("trace.json.gz", "meta.json"):
            assert (stored / name).read_bytes() == (local / name).read_bytes(), name
        meta = json.loads((local / "meta.json").read_text())
        assert meta["origin"] == "attach" and meta["pid"] == proc.pid
        report = c.get(f"captures/{cid}/report")
        assert report["schema"].startswith("aiprof.report/") and report["capture"]["ranks_found"] == [0]
        assert proc.poll() is None  # the job trains on
        print(f"attach --server: trigger -> analysed in {took:.1f} s (start_at {start}, recorded from {first})")
    finally:
        srv.stop()
        stop(proc)
