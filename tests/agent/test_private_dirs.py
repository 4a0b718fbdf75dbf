"""Issue 31, item 1: another local user who pre-creates our cache or runtime folder gets nothing.

Real processes and two real uids: an unprivileged attacker (created with useradd) prepares the
folders; the victim (root, the user the tests run as) runs the real `aiprof run` of a tiny
training job, whose capture loads the profiler stopper from the helper cache and whose agent
binds its control socket in the runtime folder.
"""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from capsupport import PY, REPO, TINY, aiprof, env_with, rank_dirs
from localusers import attacker, build_planted_so, shared_tmp  # noqa: F401  (fixtures)

NO_HOME_CACHE = "/proc/aiprof-no-cache"  # $XDG_CACHE_HOME nobody can create: the /tmp fallback is used


def _offstop_key(env: dict[str, str]) -> str:
    """The cache key of the profiler stopper for this torch (what the victim's agent looks for)."""
    r = subprocess.run([PY, "-c", "from aiprof.agent import offstop; print(offstop._plan()[0])"], env=env,
                       capture_output=True, text=True, timeout=120, check=True)
    return r.stdout.strip()


def _shim_name() -> str:
    digest = hashlib.sha256((REPO / "src" / "aiprof" / "attach" / "shim.c").read_bytes()).hexdigest()[:12]
    return f"shim-{digest}.so"


def _plant(attacker, folder: str, planted: str, names: list[str]) -> None:  # noqa: F811
    """As the attacker: the folder, mode 0777, holding the planted library under ``names``."""
    script = f"mkdir {folder} && chmod 0777 {folder}" + "".join(f" && cp {planted} {folder}/{n}" for n in names)
    attacker.run(["sh", "-c", script])
    assert os.stat(folder).st_uid == attacker.uid


def test_planted_helper_and_runtime_folder_are_refused_by_a_real_run(attacker, shared_tmp, tmp_path):  # noqa: F811
    work = tempfile.mkdtemp(prefix="aip-planted-")
    marker = os.path.join(work, "constructor-ran")
    try:
        planted = build_planted_so(work, marker)
        victim_uid = os.geteuid()
        env = env_with(os.path.join(shared_tmp, f"aiprof-{victim_uid}"), XDG_CACHE_HOME=NO_HOME_CACHE,
                       TMPDIR=shared_tmp)
        cache = os.path.join(shared_tmp, f"aiprof-cache-{victim_uid}")
        _plant(attacker, cache, planted, [f"offstop-{_offstop_key(env)}.so", _shim_name()])
        rt = env["AIPROF_RUNTIME_DIR"]
        _plant(attacker, rt, planted, [])

        out = tmp_path / "caps"
        res = aiprof(rt, "run", "--skip", "1", "--iterations", "1", "--what", "kernels", "--out", str(out),
                     "--capture-id", "p1", "--", PY, str(TINY), "--steps", "8", env=env)
        print(res.stderr)
        assert res.returncode == 0, res.stderr
        assert not os.path.exists(marker), Path(marker).read_text()
        cache_lines = [ln for ln in res.stderr.splitlines() if "ignoring the helper cache" in ln]
        assert len(cache_lines) == 1 and f"{cache} is owned by uid {attacker.uid}" in cache_lines[0], res.stderr
        rt_lines = [ln for ln in res.stderr.splitlines() if "not listening for aiprof trigger" in ln]
        assert len(rt_lines) == 1 and f"{rt} is owned by uid {attacker.uid}" in rt_lines[0], res.stderr
        assert os.listdir(rt) == []  # no socket bound in the attacker's folder
        assert "Traceback" not in res.stderr
        (d,) = rank_dirs(out, "p1")  # the requested capture still happened (driven without a socket)
        assert (d / "trace.json.gz").exists()
        # the attach CLI refuses to hand out the planted shim: it builds its own in a private folder
        # (a per-process one, removed at exit: so the facts are read in that process)
        code = ("import hashlib, os; from aiprof.attach.inject import build_shim; p = build_shim(); "
                "st = os.lstat(os.path.dirname(p)); "
                "print(p, hashlib.sha256(open(p, 'rb').read()).hexdigest(), st.st_uid, oct(st.st_mode & 0o777))")
        r = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        shim, digest, owner, mode = r.stdout.split()
        assert os.path.dirname(shim) != cache and "ignoring the helper cache" in r.stderr
        assert digest != hashlib.sha256(Path(planted).read_bytes()).hexdigest()
        assert (int(owner), mode) == (victim_uid, "0o700")
        assert not os.path.exists(marker)
    finally:
        subprocess.run(["rm", "-rf", work], timeout=60)


def test_client_ignores_a_runtime_folder_another_user_made(attacker, shared_tmp):  # noqa: F811
    """`aiprof trigger` sends nothing into a runtime folder the attacker owns (they would get our
    capture requests): one line says why, and no agent is found there."""
    rt = os.path.join(shared_tmp, f"aiprof-{os.geteuid()}")
    # a socket name for a live pid (ours), as a fake agent of the attacker would show
    attacker.run(["sh", "-c", f"mkdir {rt} && chmod 0777 {rt} && touch {rt}/agent-{os.getpid()}.sock"])
    res = aiprof(rt, "trigger", "--list")
    lines = [ln for ln in res.stderr.splitlines() if "ignoring the runtime folder" in ln]
    assert len(lines) == 1 and f"owned by uid {attacker.uid}" in lines[0], res.stderr
    assert str(os.getpid()) not in res.stdout and "Traceback" not in res.stderr


@pytest.mark.parametrize("how", ["symlink", "group-writable-foreign"])
def test_privdir_refuses_symlink_and_foreign_folders(attacker, shared_tmp, how):  # noqa: F811
    from aiprof.agent.privdir import UnsafePath, ensure_private_dir

    target = os.path.join(shared_tmp, "aim")
    path = os.path.join(shared_tmp, "victim-folder")
    if how == "symlink":  # the attacker points our name at a folder of theirs
        attacker.run(["sh", "-c", f"mkdir {target} && ln -s {target} {path}"])
        with pytest.raises(UnsafePath, match="is a symlink"):
            ensure_private_dir(path)
    else:
        attacker.run(["sh", "-c", f"mkdir {path} && chmod 0775 {path}"])
        with pytest.raises(UnsafePath, match=f"owned by uid {attacker.uid}"):
            ensure_private_dir(path)
    assert os.lstat(path).st_uid == attacker.uid  # left as found: not ours to change


def test_privdir_tightens_our_own_loose_folder(tmp_path):
    from aiprof.agent.privdir import ensure_private_dir

    d = tmp_path / "loose"
    d.mkdir()
    os.chmod(d, 0o777)  # what a umask of 0 leaves
    ensure_private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
