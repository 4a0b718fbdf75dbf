"""Opened captures of the real fixtures, shared by the analysis tests."""
from __future__ import annotations

import pytest

from aiprof.trace.store import Capture, RankTrace, open_capture


@pytest.fixture(scope="module")
def gpt2(gpt2_stall) -> RankTrace:
    return open_capture(str(gpt2_stall)).ranks[0]


@pytest.fixture(scope="module")
def ddp(ddp2_dir) -> Capture:
    return open_capture(str(ddp2_dir))
