"""Bad input: one line on stderr naming the file and the problem, exit 2, no partial store."""
from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest

from aiprof.errors import TraceError
from aiprof.trace import kineto
from aiprof.trace.store import store_dir_for

GOOD = b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]}'


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", *args], capture_output=True, text=True, timeout=120)


def _gz(data: bytes) -> bytes:
    return gzip.compress(data)


CASES = {
    "empty.json": (b"", "empty file"),
    "blank.json.gz": (_gz(b"  \n"), "empty file"),
    "truncated.json.gz": (_gz(GOOD)[:-12], "truncated gzip"),
    "notjson.json": (b"this is not json at all", "not valid JSON"),
    "other.json": (b'{"hello": [1, 2, 3]}', "not a Kineto/Chrome trace"),
    "cut.json": (GOOD[:-30], "truncated"),
    "noevents.json": (b'{"traceEvents": []}', "no profiler events"),
    "wrongtype.json": (b'{"traceEvents": 5}', "not an array"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_cli(tmp_path, name):
    data, problem = CASES[name]
    p = tmp_path / name
    p.write_bytes(data)
    res = _cli("analyze", str(p))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert str(p) in lines[0] and problem in lines[0]
    assert "Traceback" not in res.stderr
    assert not os.path.exists(store_dir_for(str(p)))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_missing_file_and_empty_dir(tmp_path):
    res = _cli("analyze", str(tmp_path / "nope.json"))
    assert res.returncode == 2 and "no such file" in res.stderr
    (tmp_path / "d").mkdir()
    res = _cli("analyze", str(tmp_path / "d"))
    assert res.returncode == 2 and "no trace files" in res.stderr


def test_vanished_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_bytes(GOOD)
    link = tmp_path / "rank0.json"
    link.symlink_to(target)
    target.unlink()  # the file vanished after the capture listed it
    res = _cli("analyze", str(link))
    assert res.returncode == 2 and "vanished" in res.stderr


def test_file_changing_mid_read_is_rejected(tmp_path, gpt2_stall):
    p = tmp_path / "t.json.gz"
    p.write_bytes(gpt2_stall.read_bytes())
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 2:  # the profiler re-exports the trace while we read it
            os.utime(p, ns=(1, 1))

    with pytest.raises(TraceError, match="changed while it was being read"):
        kineto.read_trace(str(p), progress=progress, chunk_bytes=1 << 20)
    assert not os.path.exists(store_dir_for(str(p)))


def test_deleted_mid_read_is_rejected(tmp_path, gpt2_stall):
    p = tmp_path / "t.json.gz"
    p.write_bytes(gpt2_stall.read_bytes())

    def progress(done, total):
        if os.path.exists(p):
            os.unlink(p)

    with pytest.raises(TraceError, match="disappeared"):
        kineto.read_trace(str(p), progress=progress, chunk_bytes=1 << 20)
