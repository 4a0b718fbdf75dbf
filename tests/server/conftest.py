"""Service test fixtures: the real ``aiprof server`` as a subprocess on 127.0.0.1 (a free port).

Helpers live in srvsupport.py. The browser fixtures are the UI tests' own (headless Debian
Chromium through Playwright).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.deps import need

need("uvicorn")
need("starlette")

sys.path.insert(0, str(Path(__file__).parent))
from srvsupport import start_server  # noqa: E402
from ui.conftest import open_page  # noqa: E402,F401  (browser/page come from tests/conftest.py)


@pytest.fixture
def server(tmp_path):
    s = start_server(tmp_path / "data")
    yield s
    s.stop()
