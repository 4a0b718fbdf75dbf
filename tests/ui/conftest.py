"""UI test fixtures: the real app (uvicorn on 127.0.0.1, a free port) over the fixture traces,
and a real headless Chromium (Debian's, driven by Playwright with its executable path)."""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass

import pytest

from aiprof.trace.store import open_capture

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from aiprof.server.app import create_app, static_built  # noqa: E402
from aiprof.server.data import CaptureData  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    exe = _chromium()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (make test installs it with apt-get)")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    if not static_built():
        pytest.fail("the UI front end is not built: run `make setup` (npm ci && npm run build in web/)")
    sync_api = pytest.importorskip("playwright.sync_api")
    pw = sync_api.sync_playwright().start()
    profile = tmp_path_factory.mktemp("chromium-profile")
    ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=exe, args=CHROMIUM_ARGS, headless=True,
                                                viewport={"width": 1400, "height": 900})
    yield ctx
    ctx.close()
    pw.stop()


@pytest.fixture
def page(browser):
    """A fresh tab that records console errors and uncaught exceptions; the test fails on any."""
    pg = browser.new_page()
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    pg.errors = errors
    yield pg
    pg.close()
    assert not errors, errors


def open_page(pg, base: str, route: str, timeout: float = 60_000) -> None:
    """Navigate to a page of the SPA and wait until it says it rendered (or failed)."""
    pg.goto(base + "#/" + route)
    pg.wait_for_function("() => { const p = document.querySelector('#page');"
                         " return p && p.dataset.ready && p.dataset.page === '" + route.split("?")[0] + "'; }",
                         timeout=timeout)
    assert pg.get_attribute("#page", "data-ready") != "error", pg.inner_text("#page")
