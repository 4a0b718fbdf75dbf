"""Issue 31, item 3: the token need not be on the command line (where /proc/PID/cmdline shows it
to every local user): ``$AIPROF_TOKEN``, ``--token-file`` and ``$AIPROF_TOKEN_FILE`` (0600 files;
one readable by others is refused in one line), against a real server."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deps import need

need("uvicorn")
from srvsupport import PY, start_server  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env_extra: dict[str, str], data_home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIPROF")}
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AIPROF_DATA"] = str(data_home)  # no fallback to this machine's own server token
    env.update(env_extra)
    return subprocess.run([PY, "-m", "aiprof", *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def server(tmp_path):
    srv = start_server(tmp_path / "data")
    yield srv
    srv.stop()


def _token_file(tmp_path: Path, token: str, mode: int) -> Path:
    p = tmp_path / f"token-{mode:o}"
    p.write_text(token + "\n")
    os.chmod(p, mode)
    return p


def test_token_from_env_and_0600_file_is_honoured(server, tmp_path):
    empty = tmp_path / "nodata"
    f = _token_file(tmp_path, server.token, 0o600)
    for extra_args, env in (([], {"AIPROF_TOKEN": server.token}),
                            (["--token-file", str(f)], {}),
                            ([], {"AIPROF_TOKEN_FILE": str(f)})):
        r = _cli("trigger", "--server", server.url, *extra_args, "--list", env_extra=env, data_home=empty)
        assert r.returncode == 0, (extra_args, env, r.stderr)
        assert "Traceback" not in r.stderr
    # a wrong token in the environment is really sent (and refused by the server)
    r = _cli("trigger", "--server", server.url, "--list", env_extra={"AIPROF_TOKEN": "wrong"}, data_home=empty)
    assert r.returncode != 0 and "401" in r.stderr + r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_token_file_readable_by_others_is_refused_in_one_line(server, tmp_path, mode):
    f = _token_file(tmp_path, server.token, mode)
    for args, env in ((["--token-file", str(f)], {}), ([], {"AIPROF_TOKEN_FILE": str(f)})):
        r = _cli("trigger", "--server", server.url, *args, "--list", env_extra=env, data_home=tmp_path / "nodata")
        assert r.returncode == 2, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert f"mode 0{mode:o} lets other users read the token; chmod 600 {f}" in line


def test_missing_token_file_and_token_with_token_file_are_one_line_errors(server, tmp_path):
    r = _cli("trigger", "--server", server.url, "--token-file", str(tmp_path / "absent"), "--list",
             env_extra={}, data_home=tmp_path / "nodata")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot read it" in r.stderr
    r = _cli("trigger", "--server", server.url, "--token", "a", "--token-file", "b", "--list",
             env_extra={}, data_home=tmp_path / "nodata")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr and "Traceback" not in r.stderr


def test_help_says_token_is_visible_in_cmdline():
    r = subprocess.run([sys.executable, "-m", "aiprof", "run", "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "200"})
    assert "/proc/PID/cmdline" in r.stdout and "--token-file" in r.stdout
