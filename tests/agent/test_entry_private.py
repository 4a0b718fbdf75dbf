"""`aiprof run --entry` naming a library's private function that the installed version renamed,
lost or changed: the job runs as it would without aiprof, and the agent says why it is not wrapped."""
from __future__ import annotations

import subprocess

import pytest
from capsupport import PY, SCRIPTS, aiprof, env_with, load_meta, load_trace, profiler_steps, rank_dirs

JOB = SCRIPTS / "entry_job.py"
CALLS = "30"  # 20 ms apart: long enough for the control thread to wrap the entry and record 2 iterations


def _plain(rt: str, *args: str) -> subprocess.CompletedProcess:
    """The job without aiprof: what it must still print and return under `aiprof run`."""
    return subprocess.run([PY, str(JOB), *args], capture_output=True, text=True, timeout=120, env=env_with(rt))


def _notes(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("aiprof agent[") and "--entry" in ln]


@pytest.mark.parametrize("entry, why", [
    ("entry_target:Missing.method", "entry_target has no Missing (not in the installed version?)"),
    ("entry_target:Engine._generation_loop_body", "entry_target has no Engine._generation_loop_body"),
    ("entry_target:Engine", "Engine is a type, not a function"),
    ("not_imported.module:Engine.step", "the job never imported not_imported.module"),
])
def test_entry_that_cannot_be_wrapped_leaves_the_job_alone(rt, tmp_path, entry, why):
    plain = _plain(rt, CALLS)
    assert plain.returncode == 3 and plain.stdout.startswith("total ")
    res = aiprof(rt, "run", "--entry", entry, "--iterations", "2", "--out", str(tmp_path / "caps"),
                 "--", PY, str(JOB), CALLS)
    assert (res.returncode, res.stdout) == (plain.returncode, plain.stdout), res.stderr
    (note,) = _notes(res.stderr)
    assert f"--entry {entry}" in note and why in note and "optimizer.step()" in note
    assert "Traceback" not in res.stderr


def test_entry_called_with_a_new_keyword_is_passed_through(rt, tmp_path):
    """The wrapper takes *args, **kwargs: a keyword the installed version added reaches it."""
    plain = _plain(rt, CALLS, "--new-kwarg")
    out = tmp_path / "caps"
    entry = "entry_target:Engine._loop_body"
    res = aiprof(rt, "run", "--entry", entry, "--iterations", "2", "--out", str(out), "--capture-id", "k1",
                 "--", PY, str(JOB), CALLS, "--new-kwarg")
    assert (res.returncode, res.stdout) == (3, plain.stdout), res.stderr
    assert not _notes(res.stderr)
    (d,) = rank_dirs(out, "k1")
    assert load_meta(d)["steps"]["source"] == f"entry:{entry}"
    assert len(profiler_steps(load_trace(d))) == 2
