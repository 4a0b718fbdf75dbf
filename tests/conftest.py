"""Shared test fixtures: real H200 traces (copied from the project's fixtures into tests/data).

Ingest writes a cache folder beside its input, so tests get copies in a temporary folder.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from tests.deps import need

DATA = Path(__file__).parent / "data"


def _copy(tmp_path_factory, *names: str) -> Path:
    d = tmp_path_factory.mktemp("traces")
    for n in names:
        shutil.copy(DATA / n, d / n)
    return d


@pytest.fixture(scope="module")
def data_capture(tmp_path_factory):
    """``get(rel)``: the capture folder tests/data/<rel> opened from a copy (ingest caches beside
    its input, not in the repo), once per test module and folder."""
    from aiprof.trace.store import open_capture

    cache: dict = {}

    def get(rel: str):
        if rel not in cache:
            d = tmp_path_factory.mktemp(Path(rel).name) / "cap"
            shutil.copytree(DATA / rel, d)
            cache[rel] = open_capture(str(d))
        return cache[rel]
    return get


@pytest.fixture(scope="module")
def v3b_capture(data_capture):
    """``get(name)``: the capture folder tests/data/v3b/<name> (issue 29's pairs), as data_capture."""
    return lambda name: data_capture(f"v3b/{name}")


@pytest.fixture(scope="session")
def gpt2_stall(tmp_path_factory) -> Path:
    """GPT-2 training, 1 H200; step 3 has an 80 ms sleep in get_batch (GPU idles)."""
    return _copy(tmp_path_factory, "gpt2_train_stall.json.gz") / "gpt2_train_stall.json.gz"


@pytest.fixture(scope="session")
def ddp2_dir(tmp_path_factory) -> Path:
    """GPT-2 DDP on 2 H200s; rank 1 does extra matmuls every step (the straggler)."""
    return _copy(tmp_path_factory, "ddp2_slow1_rank0.json.gz", "ddp2_slow1_rank1.json.gz")


@pytest.fixture(scope="session")
def memsnap(tmp_path_factory) -> Path:
    """torch.cuda.memory._snapshot() of the GPT-2 stall run."""
    return _copy(tmp_path_factory, "gpt2_train_stall_memsnap.pickle.gz") / "gpt2_train_stall_memsnap.pickle.gz"


@pytest.fixture(scope="session")
def ddp4_dir(tmp_path_factory) -> Path:
    """4-layer GPT-2 DDP on 4 H200s; rank 2 runs 40 extra matmuls per step (the straggler)."""
    return _copy(tmp_path_factory, *(f"ddp4_slow2_rank{r}.json.gz" for r in range(4)))


# The Makefile's `make demo` capture: examples/tiny_train.py under `aiprof run`, the same arguments.
DEMO_RUN = ["run", "--skip", "3", "--iterations", "6", "--what", "kernels,python,memory"]
DEMO_JOB = ["examples/tiny_train.py", "--steps", "14", "--slow-step", "7"]


@pytest.fixture(scope="session")
def demo_capture(tmp_path_factory) -> Path:
    """The `make demo` capture folder (CPU; step 7 sleeps 60 ms in get_batch)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("demo")
    res = subprocess.run([sys.executable, "-m", "aiprof", *DEMO_RUN, "--out", str(out), "--capture-id", "capture",
                          "--", sys.executable, *DEMO_JOB], cwd=root, capture_output=True, text=True, timeout=300)
    cap = out / "capture"
    assert (cap / "rank0" / "trace.json.gz").exists(), res.stderr[-2000:]
    return cap


# --- a real headless Chromium (Debian's), driven by Playwright with its executable path ---
# Defined once here: two session-scoped Playwright instances in one process collide (the sync
# API refuses to start while another's event loop runs in the thread).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """A persistent headless Chromium context for the whole session."""
    exe = _chromium()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (make test installs it with apt-get)")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    from aiprof.server.app import static_built

    if not static_built():
        pytest.fail("the UI front end is not built: run `make setup` (npm ci && npm run build in web/)")
    sync_api = need("playwright.sync_api")
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


@pytest.fixture(scope="session", autouse=True)
def offstop_built():
    """The agent's profiler stopper (agent/offstop.py), built once before any job runs: a job
    then loads it at its first capture request, so every capture in the tests ends the shipped
    way (detached) rather than as a race with a first build falls. Where it cannot be built the
    captures stop the old way; tests/agent/test_offstop.py fails with the reason."""
    from aiprof.agent import cbuild, offstop

    try:
        offstop.build()
    except cbuild.BuildError:
        pass
