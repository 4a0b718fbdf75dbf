"""`aiprof analyze --cluster` on a real Ray head (`ray start --head`, a subprocess), with Ray's
token authentication on (Ray >= 2.59 turns it on where a token exists) and off.

Each head has its own --temp-dir and $HOME under tmp_path (the token lives in ~/.ray/auth_token,
Ray's default place), GCS port 0 (Ray picks a free one and writes the address into
<temp-dir>/ray_current_cluster, which is also the readiness signal), one CPU and no dashboard.
It is stopped by killing its process group: `ray stop` would stop every Ray on the machine,
the embedded local Ray of other tests included.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiprof.analysis.report import build_report
from aiprof.scale import engines
from aiprof.trace.store import find_trace_files, open_capture

pytest.importorskip("ray")

# A head on two shared cores starts in 5-15 s; far above that it is broken, not slow.
HEAD_START_TIMEOUT_S = 120.0
# The whole `aiprof analyze` of two ranks on the head (connect, ingest, analyse): ~10 s here;
# a refused client gives up after Ray's own ~20 s of retries.
ANALYZE_TIMEOUT_S = 300.0
# After SIGKILL the group's processes are gone at once; waiting on `ray start` is bounded anyway.
KILL_WAIT_S = 30.0
RAY_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def _env(home: Path, **extra: str) -> dict[str, str]:
    """This test's environment for a child, without the Ray settings of this process (an
    embedded Ray started by another test sets RAY_AUTH_MODE=token in os.environ)."""
    env = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    src = str(Path(engines.__file__).resolve().parents[2])  # the aiprof under test, for the head's workers too
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p),
               AIPROF_PROGRESS="never", **extra)
    return env


def _home(root: Path, token: str | None) -> Path:
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    if token:
        (home / ".ray" / "auth_token").write_text(token)
    return home


class Head:
    """A `ray start --head --block` in its own process group; ``address`` once it is up."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.temp = root / "ray"
        self.log = root / "head.log"
        ray_cli = Path(sys.executable).with_name("ray")
        cmd = [str(ray_cli) if ray_cli.exists() else "ray", "start", "--head", "--block", "--port", "0",
               "--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats",
               "--object-store-memory", str(engines.OBJECT_STORE_BYTES), "--temp-dir", str(self.temp)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.address = ""

    def wait_address(self) -> str:
        addr_file = self.temp / "ray_current_cluster"  # written by `ray start` once the head is up
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            text = addr_file.read_text().strip() if addr_file.exists() else ""
            if text.rpartition(":")[2].isdigit():
                return text
            time.sleep(0.1)  # polling a condition, with a deadline
        raise AssertionError(f"no Ray head after {HEAD_START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the head's GCS, raylet, agents and workers
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=KILL_WAIT_S)


def _start(root: Path, env: dict[str, str]) -> Iterator[Head]:
    head = Head(root, env)
    try:
        head.address = head.wait_address()
        yield head
    finally:  # also when it never came up: its group may hold processes already
        head.stop()


@pytest.fixture(scope="module")
def token_home(tmp_path_factory) -> Path:
    """A home with a Ray token in ~/.ray/auth_token, as `ray.init()` or `ray get-auth-token
    --generate` leave it."""
    return _home(tmp_path_factory.mktemp("client"), uuid.uuid4().hex)


@pytest.fixture(scope="module")
def auth_head(tmp_path_factory, token_home) -> Iterator[Head]:
    """A head with Ray's default where a token exists: RAY_AUTH_MODE unset, token auth on."""
    yield from _start(tmp_path_factory.mktemp("auth_head"), _env(token_home))


@pytest.fixture(scope="module")
def open_head(tmp_path_factory, token_home) -> Iterator[Head]:
    """A head without authentication (RAY_AUTH_MODE=disabled), though its home has a token."""
    yield from _start(tmp_path_factory.mktemp("open_head"), _env(token_home, RAY_AUTH_MODE="disabled"))


def _analyze(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", "analyze", *args], env=env, capture_output=True,
                          text=True, timeout=ANALYZE_TIMEOUT_S, check=False)


def _in_process(ddp2_dir: Path) -> dict:
    return json.loads(json.dumps(build_report(open_capture(find_trace_files([str(ddp2_dir)])))))


def test_cluster_with_token_auth(auth_head, token_home, ddp2_dir):
    """--cluster HOST:PORT with RAY_AUTH_MODE unset: aiprof finds ~/.ray/auth_token, sends it, and
    the report on the cluster is the in-process one (two ranks: rank 1 the straggler)."""
    p = _analyze(_env(token_home), str(ddp2_dir), "--cluster", auth_head.address, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep == _in_process(ddp2_dir)
    assert [s["straggler_rank"] for s in rep["cross_rank"]["stragglers"]] == [1]
    assert rep["causes"][0]["code"] == "STRAGGLER" and rep["causes"][0]["rank"] == 1


def test_ray_address_with_token_auth(auth_head, token_home, ddp2_dir):
    """$RAY_ADDRESS instead of --cluster (with --engine ray: two ranks stay in-process otherwise)."""
    p = _analyze(_env(token_home, RAY_ADDRESS=auth_head.address), str(ddp2_dir), "--engine", "ray", "--json",
                 "--stats", str(ddp2_dir.parent / "stats.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == _in_process(ddp2_dir)
    assert json.loads((ddp2_dir.parent / "stats.json").read_text())["engine"] == "ray"


def test_cluster_without_auth(open_head, token_home, tmp_path, ddp2_dir):
    """A head without authentication: reached by a client that has a token (sent, ignored) and by
    one that has none."""
    for home in (token_home, _home(tmp_path, None)):
        p = _analyze(_env(home), str(ddp2_dir), "--cluster", open_head.address, "--json")
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout) == _in_process(ddp2_dir)


def test_token_head_without_a_token_is_one_line(auth_head, tmp_path, ddp2_dir):
    """A client with no token: one line naming what to set, exit 2, no traceback."""
    p = _analyze(_env(_home(tmp_path, None)), str(ddp2_dir), "--cluster", auth_head.address)
    assert p.returncode == 2, p.stderr[-3000:]
    (line,) = p.stderr.strip().splitlines()  # Ray's own retry warnings are kept out
    assert line.startswith(f"aiprof: error: the Ray cluster at {auth_head.address} refused this client")
    assert "$RAY_AUTH_TOKEN" in line
    assert p.stdout == ""


def test_auth_mode_token_without_a_token_is_one_line(auth_head, tmp_path, ddp2_dir):
    """RAY_AUTH_MODE=token set by the user but no token anywhere: said before connecting."""
    p = _analyze(_env(_home(tmp_path, None), RAY_AUTH_MODE="token"), str(ddp2_dir), "--cluster", auth_head.address)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "aiprof: error: RAY_AUTH_MODE=token but no Ray token was found: set $RAY_AUTH_TOKEN or "
        "$RAY_AUTH_TOKEN_PATH to the cluster's token (the head's ~/.ray/auth_token)"]
