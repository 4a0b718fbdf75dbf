"""`aiprof run` / `aiprof attach` with --probe-file and --what syscalls on real jobs: the sidecar's
files, their clock, the report's native section, the SYSCALL_BLOCKED cause; Frida missing."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from capsupport import PY, aiprof, env_with, load_meta, load_trace, rank_dirs, stop, torch_loaded, wait_for

from aiprof.native.engine import frida_status

SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS, SKIP, ITERS = 80, 4, 6  # 80 steps of ~45 ms: room for the sidecar to attach on a loaded host


def _probe_file(tmp_path: Path) -> Path:
    p = tmp_path / "probe.json"
    p.write_text(json.dumps({"libraries": [{"name": "nat", "library": "libnat.so", "symbols": [
        {"symbol": "nat_add", "args": [{"index": 0, "name": "step", "type": "u64"},
                                       {"index": 6, "name": "i", "type": "u64"}]}]}]}))
    return p


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.skipif(not frida_status()[0], reason="Frida missing")
def test_run_records_calls_and_syscalls_on_the_trace_clock(native_bin, rt, tmp_path):
    out = tmp_path / "out"
    r = aiprof(rt, "run", "--skip", str(SKIP), "--iterations", str(ITERS), "--what", "kernels,python,syscalls",
               "--probe-file", str(_probe_file(tmp_path)), "--out", str(out), "--capture-id", "c",
               "--", PY, str(SCRIPTS / "native_job.py"), str(native_bin["lib"]), str(STEPS), timeout=240)
    assert r.returncode == 0, r.stderr
    (d,) = rank_dirs(out, "c")
    meta = load_meta(d)
    assert meta["native"]["files"] == {"calls": "calls.csv", "syscalls": "syscalls.csv"}, meta["native"]
    assert meta["native"]["calls"]["hooked"] == ["nat:nat_add"]
    calls = _rows(d / "calls.csv")
    # every call of the recorded steps, none of the others: 5 per step, step numbers from the args
    steps = sorted({json.loads(c["args"])["step"] for c in calls})
    assert steps == list(range(steps[0], steps[0] + ITERS)) and len(calls) == 5 * ITERS
    assert all(c["symbol"] == "nat_add" and c["lib"] == "nat" for c in calls)
    # on the trace clock: each call inside the ProfilerStep of its own iteration
    trace = load_trace(d)
    spans = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
             if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")}
    ks = sorted(spans)
    for c in calls:
        k = ks[json.loads(c["args"])["step"] - steps[0]]
        lo, hi = spans[k]
        assert lo <= float(c["ts_us"]) <= hi, (c, k, spans[k])
    # the training thread waits in read() on the pipe
    sc = _rows(d / "syscalls.csv")
    main = [s for s in sc if int(s["tid"]) == meta["pid"] and s["syscall"] == "read"]
    assert main and all(s["path"].startswith("pipe:") and s["class"] == "io" for s in main)
    # the analysis: the report's native section and the cause
    rep = tmp_path / "rep"
    r = aiprof(rt, "analyze", str(out / "c"), "--out", str(rep), timeout=240)
    assert r.returncode == 0, r.stderr
    report = json.loads((rep / "report.json").read_text())
    nat = report["ranks"][0]["native"]
    assert nat["symbols"][0]["name"] == "nat_add" and nat["symbols"][0]["calls"] == 5 * ITERS
    assert any(s["name"] == "read" and s["cls"] == "io" for s in nat["syscalls"])
    codes = [c["code"] for c in report["causes"]]
    assert "SYSCALL_BLOCKED" in codes, codes
    cause = next(c for c in report["causes"] if c["code"] == "SYSCALL_BLOCKED")
    assert "read()" in cause["title"] and "pipe:" in cause["title"]
    assert cause["evidence"]["class"] == "io"


def test_frida_missing_is_a_note_not_a_crash(native_bin, rt, tmp_path):
    broken = tmp_path / "broken"
    (broken / "frida").mkdir(parents=True)
    (broken / "frida" / "__init__.py").write_text("raise ImportError('simulated: no frida here')\n")
    env = env_with(rt)
    env["PYTHONPATH"] = str(broken) + os.pathsep + env["PYTHONPATH"]
    out = tmp_path / "out"
    r = aiprof(rt, "run", "--skip", "2", "--iterations", "2", "--probe-file", str(_probe_file(tmp_path)),
               "--out", str(out), "--capture-id", "c", "--", PY, str(SCRIPTS / "native_job.py"),
               str(native_bin["lib"]), "40", timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    (d,) = rank_dirs(out, "c")
    meta = load_meta(d)
    notes = meta["native"]["notes"]
    assert any("Frida is not available" in n and "simulated" in n for n in notes), meta["native"]
    assert (d / "trace.json.gz").exists() and not (d / "calls.csv").exists()


@pytest.mark.skipif(not frida_status()[0], reason="Frida missing")
def test_attach_with_frida_injection_records_calls(native_bin, rt, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIPROF") and k != "PYTHONPATH"}
    job = subprocess.Popen([PY, str(SCRIPTS / "native_job.py"), str(native_bin["lib"]), "100000"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: torch_loaded(job.pid), 60, "the job to import torch")
        out = tmp_path / "out"
        r = aiprof(rt, "attach", str(job.pid), "--method", "frida", "--probe-file", str(_probe_file(tmp_path)),
                   "--skip", "2", "--iterations", "3", "--out", str(out), "--capture-id", "a", timeout=240)
        assert r.returncode == 0, r.stderr
        assert "via frida" in r.stderr
        (d,) = rank_dirs(out, "a")
        calls = _rows(d / "calls.csv")
        steps = sorted({json.loads(c["args"])["step"] for c in calls})
        assert len(steps) == 3 and len(calls) == 15
    finally:
        stop(job)
