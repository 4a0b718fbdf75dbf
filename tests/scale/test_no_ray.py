"""aiprof without Ray (no ``scale`` extra): small captures are analysed, shown and exported
without ever importing Ray; where the Ray engine would be chosen the job is analysed in this
process with one hint line; --cluster is one line and exit 2.

Ray is installed in the test environment, so each run here is a subprocess whose PYTHONPATH
starts with a `sitecustomize` that makes `import ray` raise ModuleNotFoundError, as it does
where Ray is not installed, and logs every attempt. (A real install without Ray is covered by
the wheel test in tests/wheel.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiprof.pipeline import build_report
from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.server.app import static_built
from aiprof.trace.store import find_trace_files, open_capture

SRC = str(Path(engines.__file__).resolve().parents[2])
# Each run analyses at most four small ranks: ~10 s here; far above that it hangs.
RUN_TIMEOUT_S = 300

NO_RAY = """\
# Hides Ray from this interpreter, as if aiprof were installed without its scale extra.
import os, sys

class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            with open(os.environ["AIPROF_TEST_RAY_IMPORTS"], "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoRay())
"""

# analyze (text, JSON, HTML), export, flame and the UI's app on a small capture, in one process
SMALL = """\
import json, sys
from aiprof.cli.main import main
from aiprof.server.app import static_built
cap, out = sys.argv[1], sys.argv[2]
html = ["--html", out + "/o.html"] if static_built() else []  # --html inlines the built front end
rcs = [main(["analyze", cap, "--json", "--out", out + "/rep", *html]),
       main(["export", cap, "--format", "perfetto", "-o", out + "/t.pftrace"]),
       main(["flame", cap, "-o", out + "/f.svg"])]
from starlette.testclient import TestClient
from aiprof.server.app import create_app
from aiprof.server.data import CaptureData
from aiprof.trace.store import open_capture
client = TestClient(create_app(CaptureData(open_capture([cap]))))
codes = [client.get(u).status_code for u in ("/api/overview?rank=0", "/api/overview?rank=1")]
print(json.dumps({"rcs": rcs, "http": codes, "ray": sorted(m for m in sys.modules if m.split(".")[0] == "ray")}))
"""


def _no_ray_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    site = tmp_path / "no_ray"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_RAY)
    log = tmp_path / "ray_imports.txt"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(site), SRC, env.get("PYTHONPATH")) if p),
               AIPROF_TEST_RAY_IMPORTS=str(log), AIPROF_PROGRESS="never")
    return env, log


def _aiprof(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", *args], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)


def test_the_hiding_works(tmp_path):
    env, log = _no_ray_env(tmp_path)
    p = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S, check=False)
    assert p.returncode == 1 and "ModuleNotFoundError: No module named 'ray'" in p.stderr
    assert log.read_text() == "ray\n"


def test_small_capture_never_tries_ray(tmp_path, ddp2_dir):
    """analyze, --html, export, flame and the UI's API on two ranks: all work, none tries Ray."""
    env, log = _no_ray_env(tmp_path)
    (tmp_path / "script.py").write_text(textwrap.dedent(SMALL))
    p = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(ddp2_dir), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"rcs": [0, 0, 0], "http": [200, 200], "ray": []}
    assert log.read_text() == ""
    for f in ("rep/report.json", "t.pftrace", "f.svg", *(["o.html"] if static_built() else [])):
        assert (tmp_path / f).stat().st_size > 0, f


def test_ray_engine_without_ray_runs_in_process(tmp_path, ddp4_dir):
    """--engine ray (as from RAY_MIN_RANKS ranks on auto): one hint line, exit 0, and the report
    the Ray engine gives (its per-rank pipeline, here rank after rank), whose causes are the
    in-process analysis's."""
    env, log = _no_ray_env(tmp_path)
    p = _aiprof(env, "analyze", str(ddp4_dir), "--engine", "ray", "--json", "--stats", str(tmp_path / "s.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.splitlines() == ["aiprof: Ray is not installed: analysing 4 ranks in-process "
                                     "(pip install 'aiprof[scale]' for the parallel engine)"]
    assert log.read_text().splitlines()[0] == "ray"
    rep = json.loads(p.stdout)
    files = find_trace_files([str(ddp4_dir)])
    with engines.SerialEngine() as serial:
        assert rep == json.loads(json.dumps(build_job_report(files, serial)))
    want = build_report(open_capture(files))
    assert [(c["code"], c.get("rank")) for c in rep["causes"]] == [(c["code"], c.get("rank")) for c in want["causes"]]
    assert rep["causes"][0]["code"] == "STRAGGLER" and rep["causes"][0]["rank"] == 2
    assert json.loads((tmp_path / "s.json").read_text())["engine"] == "serial"


@pytest.mark.parametrize("how", [("--cluster", "127.0.0.1:1"), ("--engine", "ray", "--cluster", "ray://head:10001")])
def test_cluster_without_ray_is_one_line(tmp_path, ddp2_dir, how):
    env, _ = _no_ray_env(tmp_path)
    p = _aiprof(env, "analyze", str(ddp2_dir), *how)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [f"aiprof: error: --cluster {how[-1]}: Ray is not installed: "
                                     "pip install 'aiprof[scale]'"]
    assert p.stdout == ""


def test_a_ray_that_cannot_be_imported_is_one_line(tmp_path, ddp4_dir):
    """A Ray that is installed but fails to import (found, so the Ray engine is chosen; imported
    only when its first task is to run): one line naming the import's error and the way round it,
    a non-zero exit, no report."""
    broken = tmp_path / "broken" / "ray"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("libray.so: cannot open shared object file")\n')
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(broken.parent), SRC, env.get("PYTHONPATH")) if p),
               AIPROF_PROGRESS="never")
    p = _aiprof(env, "analyze", str(ddp4_dir), "--engine", "ray", "--no-cache", "--json")
    assert p.returncode != 0
    assert p.stderr.splitlines() == ["aiprof: error: the Ray engine needs Ray (libray.so: cannot open shared object "
                                     "file): pip install 'aiprof[scale]'; or analyse in this process with "
                                     "--engine local"]
    assert p.stdout == ""
