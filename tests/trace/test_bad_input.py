"""Bad input: one line on stderr naming the file and the problem, exit 2, no partial store."""
from __future__ import annotations

import gzip
import json
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
    # issue 18: the real problem, with the event and the field, not "truncated"
    "no_ts.json": (GOOD.replace(b'"ts": 1, ', b""), 'traceEvents[0] (ph X, cat cpu_op, name \'a\'): "ts" is missing'),
    "no_ts_2nd.json": (b'{"traceEvents": [' + GOOD[17:-2] + b", " + GOOD[17:-2].replace(b'"ts": 1, ', b"") + b"]}",
                       'traceEvents[1] (ph X, cat cpu_op, name \'a\'): "ts" is missing'),
    "str_ts.json": (GOOD.replace(b'"ts": 1', b'"ts": "1"'), 'traceEvents[0]: "ts": expected `float`, got `str`'),
    "huge_ts.json": (GOOD.replace(b'"ts": 1', b'"ts": 1e300'), '"ts" is 1e+300, outside'),
    "huge_pid.json": (GOOD.replace(b'"pid": 1', b'"pid": 99999999999999999999'), 'traceEvents[0]: "pid": expected'),
    "bad_args.json": (GOOD.replace(b'"dur": 1}', b'"dur": 1, "args": {"External id": [1]}}'),
                      '"args.External id": expected `int | null`, got `array`'),
    "not_object.json": (b'{"traceEvents": [' + GOOD[17:-2] + b', 7]}', "traceEvents[1]: expected `object`, got `int`"),
    "nan.json": (GOOD.replace(b'"ts": 1', b'"ts": NaN'),
                 'not valid JSON inside "traceEvents" (JSON is malformed: invalid character (at byte 85 of the JSON))'),
    "deep.json": (b"[" * 100_000 + b"]" * 100_000, "traceEvents[0]: expected `object`, got `array`"),
    "deep_event.json": (b'{"traceEvents": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}",
                        "traceEvents[0]: expected `object`, got `array`"),
    "deep_meta.json": (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b", " + GOOD[1:], "JSON nested too deeply"),
    "deep_args.json.gz": (_gz(GOOD.replace(b'"dur": 1}', b'"dur": 1, "args": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
                          "JSON nested too deeply"),
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


def test_array_format_traces_are_analysed(tmp_path):
    """Issue 18: the Trace Event Format's array form, with or without its closing bracket."""
    ev = GOOD[17:-2]
    for name, data in {"array.json": b"[" + ev + b", " + ev + b"]",
                       "array_open.json": b"[" + ev + b",\n" + ev + b",\n",  # the "]" is optional
                       "array_open.json.gz": _gz(b"[\n" + ev + b",\n" + ev)}.items():
        p = tmp_path / name
        p.write_bytes(data)
        res = _cli("analyze", "--json", str(p))
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["ranks"][0]["rows"]["ops"] == 2


def test_negative_durations_count_as_zero_and_are_counted(tmp_path):
    p = tmp_path / "neg.json"
    p.write_bytes(GOOD.replace(b'"dur": 1', b'"dur": -3'))
    parsed = kineto.read_trace(str(p))
    assert parsed.tables["ops"]["dur"].tolist() == [0]
    assert parsed.meta["aiprof_negative_durations"] == 1


def test_args_that_are_not_utf8_do_not_stop_the_read(tmp_path):
    """msgspec leaves raw argument values unchecked: bytes that are not UTF-8 in "Input Dims" once
    escaped as a UnicodeDecodeError traceback. They become U+FFFD; the rest of the trace is read."""
    p = tmp_path / "t.json"
    p.write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, '
                  b'"ts": 1.0, "dur": 2.0, "args": {"Input Dims": [[2, 2]], "Input type": ["\xff\xfe"]}}]}')
    parsed = kineto.read_trace(str(p))
    ops = parsed.tables["ops"]
    assert len(ops) == 1 and "\ufffd" in ops.strings("input_types").labels[0]
    r = subprocess.run([sys.executable, "-m", "aiprof", "analyze", str(p), "--no-cache"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr


@pytest.mark.parametrize("types", [b"null", b"3.5"], ids=["null", "number"])
def test_input_types_that_are_not_a_list(tmp_path, types):
    """The fuzz run (bench/fuzz_inputs.py --cases 3000 --seed 2026) found "Input type" as null or a
    number on an op that launched a kernel: the kernels' precision lookup iterated it (TypeError
    traceback). Such an op's precision is unknown; the report is written."""
    p = tmp_path / "t.json"
    p.write_bytes(b'{"traceEvents": ['
                  b'{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0, "dur": 20.0, '
                  b'"args": {"External id": 7, "Input Dims": [[2, 2], [2, 2]], "Input type": ' + types + b'}},'
                  b'{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 5.0, '
                  b'"dur": 4.0, "args": {"correlation": 11, "External id": 7}},'
                  b'{"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 12.0, "dur": 30.0, '
                  b'"args": {"correlation": 11, "External id": 7, "device": 0, "stream": 7}}]}')
    r = subprocess.run([sys.executable, "-m", "aiprof", "analyze", str(p), "--no-cache"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
