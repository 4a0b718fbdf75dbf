"""The service shows how far an analysis is: ``aiprof analyze --progress-file`` in the child,
the capture's state while it is ``analysing`` (docs/scale.md)."""
from __future__ import annotations

import json
import shutil
import time

from srvsupport import start_server
from starlette.testclient import TestClient

from aiprof.server.analysis_queue import PROGRESS_FILE
from aiprof.server.service import create_service
from tests.conftest import DATA


def test_capture_state_shows_the_progress_file_while_analysing(tmp_path):
    app, svc = create_service(str(tmp_path / "data"))  # no lifespan: nothing re-queues the capture
    data = svc.ctx.data
    data.save_capture("big", {"capture_id": "big", "state": "analysing", "analysis": {"queued": 1.0}})
    report = tmp_path / "data" / "captures" / "big" / "report"
    report.mkdir(parents=True)
    progress = {"engine": "ray", "ranks": 1024, "phase": "analyse", "done": 300, "total": 1024,
                "phases": {"ingest": [1024, 1024], "analyse": [300, 1024]}}
    (report / PROGRESS_FILE).write_text(json.dumps(progress))
    c = TestClient(app, headers={"Authorization": f"Bearer {svc.token}"})
    st = c.get("/api/v1/captures/big").json()
    assert st["analysis"] == {"queued": 1.0, "progress": progress}
    data.update_capture("big", lambda s: s.update(state="analysed"))  # once done, the state says it
    assert "progress" not in c.get("/api/v1/captures/big").json()["analysis"]


def test_server_analysis_writes_its_progress(tmp_path):
    srv = start_server(tmp_path / "data")
    try:
        c = srv.client(timeout=30)
        for r in range(4):
            src = tmp_path / f"rank{r}.json.gz"
            shutil.copy(DATA / f"ddp4_slow2_rank{r}.json.gz", src)
            meta = tmp_path / f"meta{r}.json"
            meta.write_text(json.dumps({"rank": r, "world_size": 4}))  # a rank is complete with its meta.json
            c.upload_file("ddp4", r, str(src), "trace.json.gz", job="j")
            c.upload_file("ddp4", r, str(meta), "meta.json", job="j")
        c.post("captures/ddp4/analyze")  # (already started when its last meta.json completed it)
        deadline = time.monotonic() + 120
        while (st := c.get("captures/ddp4"))["state"] != "analysed":
            assert st["state"] in ("uploaded", "analysing"), st.get("error")
            assert time.monotonic() < deadline, st
            time.sleep(0.3)
        got = json.loads((srv.data / "captures" / "ddp4" / "report" / PROGRESS_FILE).read_text())
        assert got == {"engine": "local", "ranks": 4, "phase": "analyse", "done": 1, "total": 1,
                       "phases": {"ingest": [4, 4], "analyse": [1, 1]}}
        assert c.get("captures/ddp4/report")["cross_rank"]["stragglers"][0]["straggler_rank"] == 2
    finally:
        srv.stop()
