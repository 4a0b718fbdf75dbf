from __future__ import annotations

import pytest

from aiprof.trace.store import open_capture


@pytest.fixture(scope="session")
def gpt2_cap(gpt2_stall):
    return open_capture([str(gpt2_stall)], show_progress=False)


@pytest.fixture(scope="session")
def ddp2_cap(ddp2_dir):
    return open_capture([str(ddp2_dir)], show_progress=False)
