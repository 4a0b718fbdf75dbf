"""Fixtures for the attach/stacks tests (helpers live in tests/agent/capsupport.py)."""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))


@pytest.fixture
def rt():
    """A private, short agent runtime folder (Unix socket paths must stay under 108 bytes)."""
    d = tempfile.mkdtemp(prefix="aip-rt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
