"""Parallel ingest (aiprof.trace.workers): same tables as one process, falls back to one process
when workers cannot run, leaves no process behind."""
from __future__ import annotations

import os
import sys

import numpy as np
import psutil
import pytest

from aiprof.errors import TraceError
from aiprof.trace import kineto, workers


def _workers() -> set[int]:
    """This process's ingest workers (not the other children a test session has: a browser...)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "aiprof.trace.workers" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def _same_tables(a: kineto.ParsedTrace, b: kineto.ParsedTrace) -> None:
    assert a.n_events == b.n_events
    assert sorted(a.tables) == sorted(b.tables)
    for name, ta in a.tables.items():
        tb = b.tables[name]
        assert len(ta) == len(tb) and ta.names() == tb.names(), name
        for col in ta.names():
            x, y = ta[col], tb[col]
            if x.dtype.kind == "f":
                assert np.array_equal(x, y, equal_nan=True), (name, col)
            else:
                assert np.array_equal(x, y), (name, col)


@pytest.fixture(scope="module")
def sequential(parallel_trace) -> kineto.ParsedTrace:
    return kineto.read_trace(str(parallel_trace), workers=1)


def test_parallel_equals_sequential(parallel_trace, sequential):
    par = kineto.read_trace(str(parallel_trace), workers=2)
    assert par.workers == 2 and sequential.workers == 1
    _same_tables(par, sequential)
    assert par.meta == sequential.meta
    assert not _workers()  # the workers exited with the ingest


def test_workers_that_cannot_start_fall_back_to_one_process(parallel_trace, sequential, monkeypatch):
    # an embedded interpreter: sys.executable is not a Python that can run aiprof's worker
    monkeypatch.setattr(sys, "executable", "/bin/true")
    par = kineto.read_trace(str(parallel_trace), workers=2)
    assert par.workers == 1
    _same_tables(par, sequential)
    monkeypatch.setattr(sys, "executable", "")
    assert kineto.read_trace(str(parallel_trace), workers=2).workers == 1


def test_worker_killed_mid_ingest_falls_back(parallel_trace, sequential):
    killed = []

    def progress(done, total):
        if not killed and done > total // 3:
            for pid in _workers():
                os.kill(pid, 9)
                killed.append(pid)

    par = kineto.read_trace(str(parallel_trace), workers=2, progress=progress)
    assert killed and par.workers == 1
    _same_tables(par, sequential)
    assert not _workers()


def test_interrupt_leaves_no_worker_behind(parallel_trace):
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 3:
            assert _workers()  # the workers are running
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kineto.read_trace(str(parallel_trace), workers=2, progress=progress)
    assert not _workers()


def test_worker_answers_none_for_a_bad_block():
    with workers.WorkerPool(1) as pool:
        ok = pool.submit(memoryview(b'{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 2}'))
        bad = pool.submit(memoryview(b'{"ph": "X", "ts": "no"}'))
        broken = pool.submit(memoryview(b'{"ph": '))
        assert ok.result().n_events == 1
        assert bad.result() is None and broken.result() is None


def test_bad_worker_count_env_is_one_process(monkeypatch, capsys):
    monkeypatch.setenv("AIPROF_INGEST_WORKERS", "lots")
    assert kineto.default_workers() == 1
    assert "AIPROF_INGEST_WORKERS" in capsys.readouterr().err
    monkeypatch.setenv("AIPROF_INGEST_WORKERS", "3")
    assert kineto.default_workers() == 3


def test_bad_event_mid_file_is_named_after_the_fallback(parallel_trace, tmp_path):
    """A block that a worker declines (a bad event): the workers stop, the file is re-read here
    and the event is named by its index in the whole file."""
    data = parallel_trace.read_bytes()
    at = data.index(b'"ts": ', len(data) // 2)
    bad = tmp_path / "bad.json"
    bad.write_bytes(data[:at] + b'"ts": "soon", "was": ' + data[at + 6:])
    with pytest.raises(TraceError, match=r'traceEvents\[\d+\].*"ts": expected `float`, got `str`'):
        kineto.read_trace(str(bad), workers=2)
    assert not _workers()


def test_bad_json_in_the_tail_is_located_in_the_file(parallel_trace, tmp_path):
    """After the parallel blocks, invalid JSON in the last event is reported at its offset in
    the file, as the one-process reader reports it."""
    data = parallel_trace.read_bytes()
    at = data.rindex(b'"ts": ')
    bad = tmp_path / "tail.json"
    bad.write_bytes(data[:at] + b"@" + data[at + 1:])
    msgs = []
    for w in (2, 1):
        with pytest.raises(TraceError) as exc:
            kineto.read_trace(str(bad), workers=w)
        msgs.append(exc.value.problem)
    assert msgs[0] == msgs[1] and f"(at byte {at:,} of the JSON)" in msgs[0], msgs
