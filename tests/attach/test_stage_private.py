"""Issue 31, item 3: the attach staging script holds the server token, so only the target's user
reads it: 0600 from its creation, in a fresh private folder per attach; handed to a target of
another uid with chown (root), never left readable by a third local user."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from localusers import LocalUser, attacker, make_user, shared_tmp  # noqa: E402,F401  (fixtures)

from aiprof.attach.inject import _stage  # noqa: E402
from aiprof.attach.procs import inspect_process  # noqa: E402

TOKEN = "tok-" + "x" * 40
SERVER = {"url": "http://127.0.0.1:1", "token": TOKEN, "out": "/nonexistent", "job": None}


def _mode(p: str) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def target_user() -> Iterator[LocalUser]:
    yield from make_user()


@pytest.fixture
def private_rt() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="aip-rt-")
    yield d
    subprocess.run(["rm", "-rf", d], timeout=60)


def test_staging_script_with_token_is_0600_in_a_private_folder(private_rt):
    target = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        so, py, status = _stage(inspect_process(target.pid), private_rt, private_rt, None, SERVER)
        assert TOKEN in Path(py).read_text()
        assert _mode(py) == 0o600 and os.lstat(py).st_uid == os.geteuid()
        assert _mode(os.path.dirname(py)) == 0o700  # mkdtemp: nobody else lists or adds files
        assert _mode(os.path.join(private_rt, "attach")) == 0o711 and _mode(private_rt) == 0o711
        assert os.path.dirname(so) == os.path.dirname(py) == os.path.dirname(status)
    finally:
        target.stdin.close()  # type: ignore[union-attr]
        target.wait(30)


def test_staging_script_for_another_uid_is_theirs_alone(target_user, attacker, private_rt):  # noqa: F811
    """Root attaching to a process of ``target_user``: the script is chowned to that user, 0600;
    a third user (the attacker) can neither list the staging folder nor read the script."""
    target = target_user.popen(["sleep", "60"])
    try:
        info = inspect_process(target.pid)
        assert info.uid == target_user.uid
        _so, py, _status = _stage(info, private_rt, private_rt, None, SERVER)
        st = os.lstat(py)
        assert (st.st_uid, _mode(py)) == (target_user.uid, 0o600)
        folder = os.path.dirname(py)
        assert (os.lstat(folder).st_uid, _mode(folder)) == (target_user.uid, 0o700)
        assert target_user.run(["cat", py]).stdout.count(TOKEN) == 1  # the target's user reads it
        for cmd in (["cat", py], ["ls", os.path.join(private_rt, "attach")], ["ls", folder]):
            r = subprocess.run(cmd, user=attacker.uid, group=attacker.gid, extra_groups=[], cwd="/",
                               capture_output=True, text=True, timeout=60)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (cmd, r.stdout)
    finally:
        target.kill()
        target.wait(30)


def test_attach_refuses_a_runtime_folder_another_user_made(attacker, shared_tmp):  # noqa: F811
    """The CLI's own staging folder pre-created by another user (0777): one line, nothing written."""
    from aiprof.attach.procs import AttachError

    rt = os.path.join(shared_tmp, f"aiprof-{os.geteuid()}")
    attacker.run(["sh", "-c", f"mkdir {rt} && chmod 0777 {rt}"])
    target = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(AttachError, match=f"runtime folder {rt} is owned by uid {attacker.uid}"):
            _stage(inspect_process(target.pid), rt, rt, None, SERVER)
        assert os.listdir(rt) == []
    finally:
        target.stdin.close()  # type: ignore[union-attr]
        target.wait(30)
