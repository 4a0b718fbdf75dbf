"""The capture's meta.json says what communication settings the job ran with (issue 29, item 3):
a real 2-rank gloo job under ``aiprof run`` (torchrun), with NCCL variables in its environment;
and the SLOW_INTERCONNECT remedy names the setting a capture recorded."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from aiprof.agent.commsettings import MAX_VALUE_CHARS, MAX_VARS, comm_settings
from aiprof.pipeline import build_report
from aiprof.trace.store import open_capture

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "server" / "scripts" / "gloo_train.py"
DATA = Path(__file__).resolve().parents[1] / "data" / "diagnosis"
PAIRS = json.loads((DATA / "pairs.json").read_text())["pairs"]
# what the slow_transport2 job ran with (tests/data/diagnosis/README.md)
SOCKETS_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def test_every_rank_records_its_communication_settings(tmp_path):
    env = dict(os.environ, NCCL_P2P_DISABLE="1", NCCL_ALGO="Ring", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
               AIPROF_UNRELATED_SECRET="not read")
    r = subprocess.run([PY, "-m", "aiprof", "run", "--skip", "3", "--iterations", "2", "--out", str(tmp_path / "caps"),
                        "--", PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
                        "--seconds", "6"], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    metas = sorted((tmp_path / "caps").glob("**/rank*/meta.json"))
    assert len(metas) == 2, r.stderr[-3000:]
    for m in metas:
        comm = json.loads(m.read_text())["communication"]
        assert comm["env"]["NCCL_P2P_DISABLE"] == "1" and comm["env"]["NCCL_ALGO"] == "Ring"
        assert comm["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert "AIPROF_UNRELATED_SECRET" not in comm["env"]
        assert comm["process_group"]["backend"] == "gloo" and comm["process_group"]["world_size"] == 2


def test_settings_are_bounded(monkeypatch):
    for k in range(MAX_VARS + 10):
        monkeypatch.setenv(f"NCCL_TEST_{k:04d}", "x" * (MAX_VALUE_CHARS + 5))
    env = comm_settings()["env"]
    assert len(env) == MAX_VARS and all(len(v) <= MAX_VALUE_CHARS for v in env.values())


def test_past_the_bound_other_libraries_variables_are_cut_not_nccls(monkeypatch):
    # libfabric (FI_*) and CUDA sort before NCCL: an alphabetical cut dropped NCCL's own settings
    for k in range(MAX_VARS + 10):
        monkeypatch.setenv(f"FI_TEST_{k:04d}", "1")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = comm_settings()["env"]
    assert len(env) == MAX_VARS and env["NCCL_P2P_DISABLE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def _slow_transport(tmp_path, env: dict | None) -> dict:
    p = PAIRS["slow_transport2"]
    for r, t in enumerate(p["traces"]["fault"]):
        rd = tmp_path / f"rank{r}"
        rd.mkdir(parents=True)
        shutil.copy(DATA / t, rd / "trace.json.gz")
        meta = {"schema": "aiprof.capture/1", "steps": {"before_median_ms": p["per_rank_ms"][str(r)]["fault"]}}
        if env is not None:
            meta["communication"] = {"env": env, "process_group": {"backend": "nccl", "world_size": 2}}
        (rd / "meta.json").write_text(json.dumps(meta))
    c = build_report(open_capture(str(tmp_path)))["causes"][0]
    assert c["code"] == "SLOW_INTERCONNECT"
    return c


def test_slow_interconnect_names_the_setting_the_job_ran_with(tmp_path):
    c = _slow_transport(tmp_path / "with", SOCKETS_ENV)
    assert c["remedy"].startswith("This job ran with NCCL_P2P_DISABLE=1 (turns NVLink/PCIe peer-to-peer off): unset it")
    # shared memory off is the fallback NCCL lost, not why it left NVLink: named after, as such
    assert "It also set NCCL_SHM_DISABLE=1" in c["remedy"]
    assert "NCCL_IB_DISABLE" not in c["remedy"]  # InfiniBand is not how two GPUs of one host talk
    assert [(s["name"], s["off_nvlink"]) for s in c["evidence"]["settings"]] == [("NCCL_P2P_DISABLE", True),
                                                                                ("NCCL_SHM_DISABLE", False)]
    # an older capture without the settings: the list of what to check, no setting named
    plain = _slow_transport(tmp_path / "without", None)
    assert plain["remedy"].startswith("Let NCCL use NVLink") and plain["evidence"]["settings"] == []


def test_settings_that_keep_nvlink_are_never_the_reason(tmp_path):
    # a pinned algorithm and protocol change how NCCL uses NVLink, not whether: the general
    # remedy leads (containers, visibility, topology), the pins are named after it
    c = _slow_transport(tmp_path, {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"})
    assert c["remedy"].startswith("Let NCCL use NVLink") and "--ipc=host" in c["remedy"]
    assert "It also set NCCL_PROTO=Simple (pins the protocol), NCCL_ALGO=Ring (pins the algorithm)" in c["remedy"]
    assert not any(s["off_nvlink"] for s in c["evidence"]["settings"])
