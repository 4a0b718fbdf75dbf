"""`aiprof flame` and `aiprof export` on a CPU-only capture of examples/tiny_train.py (made with
`aiprof run`): they say what the capture lacks and which option adds it, and write nothing
when nothing can be drawn."""
from __future__ import annotations

import os
import sys

import pytest
from clisupport import REPO, aiprof


@pytest.fixture(scope="module")
def cpu_capture(tmp_path_factory):
    out = tmp_path_factory.mktemp("caps")
    rt = tmp_path_factory.mktemp("rt")
    res = aiprof("run", "--skip", "2", "--iterations", "2", "--what", "kernels", "--out", str(out),
                 "--capture-id", "c", "--", sys.executable, str(REPO / "examples" / "tiny_train.py"), "--steps", "6",
                 AIPROF_RUNTIME_DIR=str(rt))
    assert res.returncode == 0, res.stderr
    return out / "c"


def test_flame_gpu_graph_of_a_cpu_capture(cpu_capture, tmp_path):
    out = tmp_path / "g.svg"
    res = aiprof("flame", str(cpu_capture), "-o", str(out))
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "no GPU work" in res.stderr and "--what cpu" in res.stderr
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".aiprof-")]


def test_flame_cpu_graph_notes_missing_python(cpu_capture, tmp_path):
    res = aiprof("flame", str(cpu_capture), "--what", "cpu", "-o", str(tmp_path / "c.svg"))
    assert res.returncode == 0, res.stderr
    assert "no Python frames" in res.stderr and "--what kernels,python" in res.stderr
    both = aiprof("flame", str(cpu_capture), "--what", "both", "-o", str(tmp_path / "b.html"))
    assert both.returncode == 0 and "warning: empty GPU graph" in both.stderr


def test_export_says_what_the_capture_lacks(cpu_capture, tmp_path):
    res = aiprof("export", str(cpu_capture), "--format", "chrome", "-o", str(tmp_path / "t.json"))
    assert res.returncode == 0, res.stderr
    assert "no GPU work in the capture" in res.stderr and "no Python frames" in res.stderr
    res = aiprof("export", str(cpu_capture), "--format", "chrome", "--no-host", "-o", str(tmp_path / "n.json"))
    assert res.returncode == 2 and "leave out --no-host" in res.stderr and not (tmp_path / "n.json").exists()
    res = aiprof("export", str(cpu_capture), "--format", "folded", "-o", str(tmp_path / "f.txt"))
    assert res.returncode == 2 and "--what cpu" in res.stderr and not (tmp_path / "f.txt").exists()
