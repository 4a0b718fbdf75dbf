"""Throwaway local users for the shared-host tests (tests/agent, tests/attach): created with
``useradd`` when the tests run as root, removed afterwards; a clear skip otherwise."""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

USER_PREFIX = "aiptst"  # every user these tests create starts so (easy to find if a run is killed)
CMD_TIMEOUT_S = 60


@dataclass
class LocalUser:
    name: str
    uid: int
    gid: int

    def run(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """Run ``cmd`` as this user (no supplementary groups), checked, output captured."""
        return subprocess.run(cmd, user=self.uid, group=self.gid, extra_groups=[], cwd="/", check=True,
                              capture_output=True, text=True, timeout=CMD_TIMEOUT_S, **kw)

    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(cmd, user=self.uid, group=self.gid, extra_groups=[], cwd="/", **kw)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a second local user (useradd)"
    if not shutil.which("useradd") or not shutil.which("userdel"):
        return "useradd/userdel are not installed"
    return None


def make_user() -> Iterator[LocalUser]:
    """Create a user with a unique name; yields it; removes it (and nothing else) afterwards."""
    why = _why_not()
    if why:
        pytest.skip(why)
    name = f"{USER_PREFIX}{secrets.token_hex(4)}"
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if r.returncode != 0:
        pytest.skip(f"useradd {name} failed: {r.stderr.strip()[:200]}")
    try:
        pw = pwd.getpwnam(name)
        yield LocalUser(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=CMD_TIMEOUT_S)


@pytest.fixture
def attacker() -> Iterator[LocalUser]:
    yield from make_user()


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A folder like /tmp (1777): every local user may create entries, none may remove others'."""
    d = tempfile.mkdtemp(prefix="aip-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


PLANTED_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fprintf(f, "planted constructor ran as uid %d\n", (int)getuid()); fclose(f); }
}
"""


def build_planted_so(workdir: str, marker: str) -> str:
    """A shared object whose constructor writes ``marker`` (the attacker's payload)."""
    src = os.path.join(workdir, "planted.c")
    with open(src, "w") as f:
        f.write(PLANTED_C)
    out = os.path.join(workdir, "planted.so")
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler to build the planted library")
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", out, src], check=True,
                   capture_output=True, timeout=CMD_TIMEOUT_S)
    os.chmod(out, 0o755)
    os.chmod(workdir, 0o755)  # the attacker copies it from here
    return out
