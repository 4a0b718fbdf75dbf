"""Issue 19: the README's Python snippet works as users run it, on a trace that takes the
parallel ingest path: a top-level script without a ``__main__`` guard, ``python - < script.py``
and a Jupyter notebook cell. The ingest workers must never run the caller's ``__main__``.
"""
from __future__ import annotations

from tests.trace.conftest import load_bench

CONTEXTS = load_bench("ingest_contexts")
WORKERS = 2


def _check(r: dict) -> None:
    assert r["workers"] == WORKERS, r  # the parallel path ran, with aiprof's own workers
    assert r["top_level_runs"] == 1, r  # nothing re-ran the caller's top level
    assert r["kernels"] > 0 and r["steps"] > 0 and r["schema"].startswith("aiprof.report/")
    assert "Traceback" not in r["stderr"], r["stderr"]


def test_script_without_main_guard(parallel_trace, tmp_path):
    _check(CONTEXTS.run_script(parallel_trace, tmp_path, workers=WORKERS))


def test_script_from_stdin(parallel_trace, tmp_path):
    _check(CONTEXTS.run_stdin(parallel_trace, tmp_path, workers=WORKERS))


def test_jupyter_notebook_cell(parallel_trace, tmp_path):
    _check(CONTEXTS.run_notebook(parallel_trace, tmp_path, workers=WORKERS))
