"""`aiprof analyze` end to end, as a user runs it."""
from __future__ import annotations

import json
import subprocess
import sys


def _aiprof(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", *args], capture_output=True, text=True, timeout=300)


def test_analyze_json_schema(gpt2_stall, tmp_path):
    res = _aiprof("analyze", str(gpt2_stall), "--json", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["schema"] == "aiprof.report/2"
    (r,) = rep["ranks"]
    assert isinstance(r["rank"], int)
    for s in r["steps"]:
        for k in ("step", "duration_us", "compute_us", "communication_us", "memory_us", "idle_us"):
            assert k in s
    assert isinstance(rep["causes"], list) and isinstance(rep["symptoms"], list)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["ranks"][0]["steps"] == r["steps"]
    assert "Steps" in (tmp_path / "out" / "report.txt").read_text()


def test_analyze_text_directory(ddp2_dir):
    res = _aiprof("analyze", str(ddp2_dir))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "2 rank(s) of world size 2" in out
    assert "ncclDevKernel_AllReduce" in out and "communication" in out
    assert "Rank 1" in out


def test_help_lists_verbs():
    res = _aiprof("--help")
    assert res.returncode == 0 and "analyze" in res.stdout
    res = _aiprof("analyze", "--help")
    assert res.returncode == 0 and "--json" in res.stdout


def test_progress_bar_on_a_terminal_goes_to_stderr(gpt2_stall, tmp_path):
    """On a terminal, ingest shows a rich progress bar on stderr; stdout stays the report."""
    import os
    import pty
    import select
    import shutil
    import threading

    p = tmp_path / "t.json.gz"
    shutil.copy(gpt2_stall, p)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "aiprof", "analyze", str(p), "--json"], stdout=subprocess.PIPE,
                            stderr=slave, stdin=slave, env={**os.environ, "AIPROF_PROGRESS": "always"})
    os.close(slave)
    # stdout is read while the child runs: a report larger than the pipe buffer would block it
    out_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    err = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            err += chunk
        elif proc.poll() is not None:
            break
    assert proc.wait(timeout=120) == 0
    reader.join(60)
    out = b"".join(out_chunks)
    assert b"ingest" in err and b"MB" in err
    assert json.loads(out)["schema"] == "aiprof.report/2"
