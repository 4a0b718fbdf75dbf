"""A Kineto trace large enough for parallel ingest, made once per session from real H200 steps."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from aiprof.trace import kineto

ROOT = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    """A bench/ script as a module (its generators and runners are shared with the tests)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def parallel_trace(tmp_path_factory) -> Path:
    """Just over kineto.PARALLEL_MIN_BYTES: steps of tests/data/gpt2_train_stall.json.gz, replicated."""
    path = tmp_path_factory.mktemp("parallel") / "big.json"
    size_mb = kineto.PARALLEL_MIN_BYTES // 1_000_000 + 2
    nbytes = load_bench("ingest").generate(path, size_mb)["bytes"]
    assert nbytes >= kineto.PARALLEL_MIN_BYTES
    return path
