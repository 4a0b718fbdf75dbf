"""Fixtures for the capture-agent tests."""
from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def rt():
    """A private, short agent runtime folder (Unix socket paths must stay under 108 bytes)."""
    d = tempfile.mkdtemp(prefix="aip-rt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
