"""UI test fixtures: the real app (uvicorn on 127.0.0.1, a free port) over the fixture traces.
The headless Chromium fixtures (`browser`, `page`) are in tests/conftest.py, shared with the
service tests: one Playwright instance per session."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from aiprof.trace.store import open_capture

from tests.deps import need

uvicorn = need("uvicorn")
need("starlette")

from aiprof.server.app import create_app  # noqa: E402
from aiprof.server.data import CaptureData  # noqa: E402

@dataclass
class Served:
    url: str
    data: CaptureData
    report: dict


def _serve(paths, memory_snapshot=None):
    data = CaptureData(open_capture([str(p) for p in paths]), memory_snapshot=memory_snapshot)
    report = data.report()
    server = uvicorn.Server(uvicorn.Config(create_app(data), host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.time()
    while not server.started:
        assert time.time() - t0 < 30, "the UI server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, th, Served(f"http://127.0.0.1:{port}/", data, report)


@pytest.fixture(scope="session")
def gpt2_app(gpt2_stall, memsnap):
    server, th, s = _serve([gpt2_stall], memory_snapshot=str(memsnap))
    yield s
    server.should_exit = True
    th.join(10)


@pytest.fixture(scope="session")
def ddp_app(ddp2_dir):
    server, th, s = _serve([ddp2_dir])
    yield s
    server.should_exit = True
    th.join(10)


def open_page(pg, base: str, route: str, timeout: float = 60_000) -> None:
    """Navigate to a page of the SPA and wait until it says it rendered (or failed)."""
    pg.goto(base + "#/" + route)
    pg.wait_for_function("() => { const p = document.querySelector('#page');"
                         " return p && p.dataset.ready && p.dataset.page === '" + route.split("?")[0] + "'; }",
                         timeout=timeout)
    assert pg.get_attribute("#page", "data-ready") != "error", pg.inner_text("#page")
