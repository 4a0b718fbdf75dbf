"""Fixtures of the Python API's tests (issue 30, item 4): real committed traces, opened once."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import aiprof

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


@pytest.fixture(scope="session")
def pd():
    """pandas, which aiprof does not depend on: the tests of to_pandas() need it. Missing in
    CI is a failure (the test extra must name it), elsewhere a skip."""
    try:
        import pandas
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("pandas is missing: it must be in the test extra for the DataFrame API's tests")
        pytest.skip("pandas is not installed (pip install pandas)")
    return pandas


@pytest.fixture(scope="session")
def stall_cap(gpt2_stall):
    """GPT-2 on one H200; get_batch sleeps 80 ms in step 3 (tests/data/README.md)."""
    return aiprof.open(gpt2_stall)


@pytest.fixture(scope="session")
def ddp2_cap(ddp2_dir):
    """GPT-2 DDP on 2 H200s; rank 1 is the straggler."""
    return aiprof.open(ddp2_dir)


@pytest.fixture(scope="session")
def pm_cap(tmp_path_factory):
    """One rank of an NVLink job with GPU PM counter samples (pm.csv.gz) and NVML samples (hw.csv)."""
    d = tmp_path_factory.mktemp("pm") / "rank0"
    shutil.copytree(DATA / "nvlink_pm_h200x2" / "rank0", d)
    return aiprof.open(d)
