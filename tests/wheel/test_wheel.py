"""A wheel that works alone (issue 26). Built from a clean clone's files (`git ls-files`: no built
front end, no node_modules) and installed into a fresh venv, with nothing of this checkout on its
path: alone it analyses a capture (no Ray there: the `scale` extra is not needed) and asks for the
`ui` extra for --html in one line; with `ui` added it writes the HTML report and serves the web UI
with its front end.

One build and one venv for the session (npm ci + vite + pip: about a minute on 2 cores).
"""
from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from tests import procs

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "lock.txt"  # exact versions (make lock); used as constraints when present
TRACE = REPO / "tests" / "data" / "gpt2_train_stall.json.gz"  # GPT-2, 1 H200, 5 steps, 2.6 MB
SETUPTOOLS_MIN = (77,)  # pyproject's build-system.requires: the build runs with this venv's own
# bounds on the real work, generous for CI's 2 cores and a cold npm/pip cache; never waited out
BUILD_TIMEOUT_S = 900  # npm ci (downloads vite & co. when cold) + vite build + setuptools
INSTALL_TIMEOUT_S = 900  # numpy, pyarrow, msgspec, rich, starlette, uvicorn into an empty venv
RUN_TIMEOUT_S = 300  # `aiprof analyze` of TRACE
SERVE_TIMEOUT_S = 120  # `aiprof ui` start until it prints its URL
HTTP_TIMEOUT_S = 120  # one request (the first /api/ call waits for the analysis)
APP_BUNDLE_MIN_BYTES = 100_000  # the built assets/app.js is ~680 kB; a missing or empty build is far less
URL_RE = re.compile(rb"http://127\.0\.0\.1:\d+/")
ASSET_RE = re.compile(r'(?:src|href)="\.?/?(assets/[^"]+)"')


def _clean_env() -> dict[str, str]:
    """This process's environment minus whatever would put this checkout or this venv on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run to completion within ``timeout``; fail with its output when it exits non-zero."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=_clean_env(), **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _missing(why: str) -> None:
    """A prerequisite of the test (not of aiprof) is missing: fail on CI, skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def constraints_from_lock(lock: Path, out: Path) -> Path:
    """requirements/lock.txt as a pip constraints file: pins and their markers only.

    Constraints take no options (--hash, --index-url, -e), no extras and no entry for the project
    itself, so those are dropped; continuation lines are joined first.
    """
    text = lock.read_text(encoding="utf-8").replace("\\\n", " ")
    keep = []
    for line in text.splitlines():
        line = re.sub(r"\s--hash[=\s]\S+", "", " " + line).strip()
        line = re.split(r"\s#", line, maxsplit=1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?", line)
        if not m or re.sub(r"[-_.]+", "-", m.group(1)).lower() == "aiprof":
            continue
        keep.append(m.group(1) + line[m.end():])
    out.write_text("\n".join(keep) + "\n", encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def clean_clone(tmp_path_factory) -> Path:
    """The tracked files of this checkout (as they are in the work tree) in a new folder."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the clean-clone build needs `git ls-files`")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True,
                           timeout=60).stdout.decode().split("\0")
    dst = tmp_path_factory.mktemp("clone")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():  # a tracked file deleted in the work tree is not in the clone either
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    assert not (dst / "src/aiprof/server/static").exists() and not (dst / "web/node_modules").exists()
    return dst


@pytest.fixture(scope="session")
def wheel(clean_clone, tmp_path_factory) -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        _missing("node and npm are needed to build the wheel's web UI (make setup needs them too)")
    try:
        have = tuple(int(x) for x in re.findall(r"\d+", metadata.version("setuptools"))[:1])
    except metadata.PackageNotFoundError:
        have = ()
    if have < SETUPTOOLS_MIN:
        _missing(f"this venv needs setuptools>={SETUPTOOLS_MIN[0]} to build without isolation (make setup installs it)")
    out = tmp_path_factory.mktemp("wheelhouse")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, clean_clone],
         BUILD_TIMEOUT_S, cwd=out)
    wheels = list(out.glob("aiprof-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="session")
def base_runs(wheel, tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """A fresh venv with the wheel alone (no extras), and `aiprof analyze` run there with and without
    --html (recorded here, before the `venv` fixture adds the `ui` extra to the same venv)."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", root], INSTALL_TIMEOUT_S)
    _pip_install(root, str(wheel))
    work = tmp_path_factory.mktemp("base")
    runs = {name: subprocess.run([str(root / "bin" / "aiprof"), "analyze", str(_trace_copy(work)), *more],
                                 capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=work, env=_clean_env())
            for name, more in (("text", []), ("html", ["--html", str(work / "out.html")]))}
    runs["html_written"] = (work / "out.html").exists()
    return root / "bin", runs


@pytest.fixture(scope="session")
def venv(base_runs, wheel) -> Path:
    """The same venv with the wheel's `ui` extra added; returns its bin/ folder."""
    bin_dir = base_runs[0]
    _pip_install(bin_dir.parent, f"{wheel}[ui]")
    return bin_dir


def _pip_install(root: Path, spec: str) -> None:
    cmd = [root / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q", spec]
    if LOCK.is_file():
        cmd += ["-c", constraints_from_lock(LOCK, root / "constraints.txt")]
    _run(cmd, INSTALL_TIMEOUT_S, cwd=root)


def _trace_copy(tmp_path: Path) -> Path:
    # ingest writes its cache beside its input: a private copy per test
    dst = tmp_path / TRACE.name
    shutil.copy(TRACE, dst)
    return dst


def test_wheel_has_the_built_ui_and_the_sdist_its_sources(wheel, clean_clone, tmp_path):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "aiprof/server/static/index.html" in names and "aiprof/server/static/assets/app.js" in names
    assert not [n for n in names if "node_modules" in n or n.startswith("web/")]
    # the sdist built from the same tree, which now holds node_modules and a built static/ too
    _run([sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(tmp_path)!r})"],
         BUILD_TIMEOUT_S, cwd=clean_clone)
    (sdist,) = tmp_path.glob("aiprof-*.tar.gz")
    with tarfile.open(sdist) as t:
        listed = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    web = [f for f in subprocess.run(["git", "ls-files", "web"], cwd=REPO, capture_output=True, text=True,
                                     check=True, timeout=60).stdout.split()]
    assert {"web/package.json", "web/package-lock.json", "web/index.html", "web/vite.config.js",
            "web/src/main.js"} <= set(web) <= listed, sorted(set(web) - listed)
    assert not [n for n in listed if "node_modules" in n or "server/static/" in n]


def test_base_install_analyses_without_ray_and_asks_for_ui_for_html(base_runs):
    """No extras at all: the report is printed; --html says in one line which extra it needs."""
    _, runs = base_runs
    text, html = runs["text"], runs["html"]
    assert text.returncode == 0 and "step" in text.stdout.lower(), text.stderr[-4000:]
    assert html.returncode == 2 and not runs["html_written"], html.stderr[-4000:]
    assert html.stderr.strip().count("\n") == 0 and "aiprof[ui]" in html.stderr, html.stderr


def test_installs_alone_without_ray(venv):
    r = _run([venv / "python", "-c", "import aiprof, importlib.util; print(aiprof.__file__); "
              "print(importlib.util.find_spec('ray'))"], RUN_TIMEOUT_S, cwd=venv)
    where, ray = r.stdout.split()
    assert Path(where).is_relative_to(venv.parent), where  # the wheel's copy, not this checkout
    assert ray == "None", "ray is installed by the base+ui install; it belongs to the scale extra"


def test_analyze_writes_the_html_report(venv, tmp_path):
    out = tmp_path / "out.html"
    r = _run([venv / "aiprof", "analyze", _trace_copy(tmp_path), "--html", out], RUN_TIMEOUT_S, cwd=tmp_path)
    assert "step" in r.stdout.lower()
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and 'id="page"' in page and "window.__AIPROF_STATIC__" in page
    assert "./assets/" not in page  # self-contained: the bundle is inlined, nothing fetched
    bundle = page.split('<script type="module">', 1)[1].split("</script>", 1)[0]
    assert len(bundle) > APP_BUNDLE_MIN_BYTES


def _wait_for_url(proc: subprocess.Popen, errlog: Path) -> str:
    """The URL `aiprof ui` prints once it listens; fails when it exits or SERVE_TIMEOUT_S pass."""
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not (m := URL_RE.search(seen)):
            left = deadline - time.monotonic()
            assert left > 0, f"aiprof ui printed no URL in {SERVE_TIMEOUT_S} s: {seen!r} {errlog.read_text()}"
            if sel.select(left):
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"aiprof ui exited {proc.wait(10)}: {seen!r} {errlog.read_text()}"
                seen += chunk
    return m.group(0).decode()


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
        return r.status, r.headers.get("content-type", ""), r.read()


def test_ui_serves_the_api_and_the_built_front_end(venv, tmp_path):
    errlog = tmp_path / "ui.stderr"
    with open(errlog, "wb") as err:
        proc = subprocess.Popen([str(venv / "aiprof"), "ui", str(_trace_copy(tmp_path)), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=err, cwd=tmp_path, env=_clean_env())
    try:
        base = _wait_for_url(proc, errlog)
        status, _, body = _get(base + "api/meta")
        meta = json.loads(body)
        assert status == 200 and meta["world_size"] == 1 and meta["ranks"][0]["steps"] == [1, 2, 3, 4, 5]
        status, ctype, body = _get(base)
        page = body.decode()
        assert status == 200 and ctype.startswith("text/html") and 'id="page"' in page
        assets = ASSET_RE.findall(page)
        assert "assets/app.js" in assets, page
        for a in assets:
            status, ctype, body = _get(base + a)
            assert status == 200 and body, a
            if a.endswith(".js"):
                assert "javascript" in ctype, (a, ctype)
        assert len(_get(base + "assets/app.js")[2]) > APP_BUNDLE_MIN_BYTES
    finally:
        procs.stop(proc)
        proc.stdout.close()
    assert "not built" not in errlog.read_text(), errlog.read_text()


def test_lock_becomes_constraints(tmp_path):
    """The lock's pip-compile/uv form (hashes, options, comments, extras, the project) -> plain pins."""
    lock = tmp_path / "lock.txt"
    lock.write_text("# generated by make lock\n--index-url https://pypi.org/simple\n-e file:///src/aiprof\n"
                    "aiprof @ file:///src/aiprof\n"
                    "numpy==2.1.3 \\\n    --hash=sha256:aa --hash=sha256:bb\n    # via aiprof\n"
                    "uvicorn[standard]==0.30.1 ; python_version >= \"3.10\" \\\n    --hash=sha256:cc\n"
                    "Ray==2.9.3  # via aiprof\n", encoding="utf-8")
    got = constraints_from_lock(lock, tmp_path / "c.txt").read_text().splitlines()
    assert got == ["numpy==2.1.3", 'uvicorn==0.30.1 ; python_version >= "3.10"', "Ray==2.9.3"]
