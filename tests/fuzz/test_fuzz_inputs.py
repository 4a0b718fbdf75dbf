"""Property tests (issue 18): random, hostile and unlucky trace files never crash aiprof.

Only two outcomes are allowed for ``aiprof analyze``: a report (and a complete store), or one
line on stderr naming the file with exit 2 (and no store). The examples are derandomized so CI
sees the same cases every run; bench/fuzz_inputs.py runs a larger random campaign.
"""
from __future__ import annotations

import json
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiprof.errors import TraceError
from aiprof.trace import kineto
from tests.fuzz.inputs import KINDS, check_cli, event, trace_file

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                        HealthCheck.data_too_large])


@settings(FUZZ, max_examples=250)
@given(trace_file())
def test_any_trace_file_gives_a_report_or_one_line_error(data):
    o = check_cli(data)
    assert o.kind != "traceback", o.detail


@settings(FUZZ, max_examples=60)
@given(st.sets(st.sampled_from(KINDS), min_size=1).flatmap(lambda ks: trace_file(tuple(sorted(ks)), hostile=False)))
def test_every_subset_of_event_kinds_is_analysed(data):
    o = check_cli(data)
    assert o.kind != "traceback", o.detail
    if o.kind == "error":  # well-formed events: the only refusal is a trace with nothing aiprof reads
        assert "no profiler events" in o.stderr, o.stderr


def _read(path: str, chunk: int):
    try:
        p = kineto.read_trace(path, chunk_bytes=chunk, workers=1)
    except TraceError as exc:
        return "error", exc.problem
    return "ok", (p.n_events, {k: len(t) for k, t in p.tables.items()})


@settings(FUZZ, max_examples=80)
@given(trace_file(), st.integers(64, 2048))
def test_where_the_reader_cuts_does_not_change_the_outcome(data, chunk):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        with open(path, "wb") as f:
            f.write(data)
        whole, cut = _read(path, kineto.CHUNK_BYTES), _read(path, chunk)
    assert whole[0] == cut[0], (whole, cut)
    if whole[0] == "ok" or (whole[1].startswith("traceEvents[") and cut[1].startswith("traceEvents[")):
        assert whole == cut  # same tables, or the same bad event named (a file may have several problems)


@settings(FUZZ, max_examples=150)
@given(st.lists(event(hostile=True), max_size=20))
def test_a_worker_block_decodes_or_declines(events):
    """What a parallel-ingest worker does with a block: a builder, or None (never an exception)."""
    body = ",\n".join(json.dumps(e) for e in events).encode()
    b = kineto.decode_block(b"[" + body + b"]")
    assert b is None or b.n_events == len(events)
