"""Fixtures for the CLI tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from clisupport import DATA


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory) -> Path:
    """A small real GPU trace (fp32 matmuls with TF32 off, on an H100), copied: ingest caches beside it."""
    d = tmp_path_factory.mktemp("small")
    shutil.copy(DATA / "scenarios" / "fp32_matmul.json.gz", d / "fp32_matmul.json.gz")
    return d / "fp32_matmul.json.gz"
