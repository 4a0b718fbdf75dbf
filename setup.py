"""Builds the web UI's front end into the package when a wheel is built (issue 26: a wheel that works
alone). Everything else about the package is in pyproject.toml.

web/ (vite) builds into src/aiprof/server/static/, which is not committed, so a wheel built from a
clean clone or from the sdist would ship without it (`aiprof ui` answers 503, `analyze --html`
exits 2). build_py therefore runs `npm ci && npm run build` in web/ first when the built files are
missing or older than web/'s sources, and stops with one line when node/npm are missing. Editable
installs (`make setup`) never fail on it: they use the tree's files and warn instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
WEB = os.path.join(HERE, "web")
STATIC = os.path.join(HERE, "src", "aiprof", "server", "static")
# what vite always writes (vite.config.js fixes the names; static_report.py inlines app.js)
BUILT = [os.path.join(STATIC, "index.html"), os.path.join(STATIC, "assets", "app.js")]
# the inputs of `npm run build`; a change to any of them makes the built files stale
WEB_INPUTS = ["package.json", "package-lock.json", "index.html", "vite.config.js", "src"]


def _newest_input() -> float:
    newest = 0.0
    for name in WEB_INPUTS:
        path = os.path.join(WEB, name)
        if os.path.isdir(path):
            for d, _, files in os.walk(path):
                newest = max([newest] + [os.path.getmtime(os.path.join(d, f)) for f in files])
        elif os.path.exists(path):
            newest = max(newest, os.path.getmtime(path))
    return newest


def _ui_state() -> str | None:
    """None when the built front end is present and newer than web/'s sources, else why not."""
    if not all(os.path.isfile(p) for p in BUILT):
        return "is not built"
    if min(os.path.getmtime(p) for p in BUILT) < _newest_input():
        return "is older than web/'s sources"
    return None


class BuildPyWithUI(build_py):
    """build_py that builds web/ into the package first (see the module's docstring)."""

    def run(self) -> None:
        why = _ui_state()
        if why is not None:
            self._build_ui(why)
            # package_data globs are matched once and cached; match again to pick up the new files
            self.__dict__.pop("data_files", None)
        super().run()

    def _build_ui(self, why: str) -> None:
        if not os.path.isfile(os.path.join(WEB, "package-lock.json")):
            return self._fail(f"aiprof's web UI {why} and web/package-lock.json is missing: "
                              "build from a clone or the sdist")
        npm = shutil.which("npm")
        if npm is None or shutil.which("node") is None:
            return self._fail(f"aiprof's web UI {why}, and building it needs node 20+ with npm on PATH "
                              "(https://nodejs.org): install them and build again")
        for step in (["ci", "--no-audit", "--no-fund"], ["run", "build"]):
            print(f"aiprof: web UI {why}: npm {' '.join(step)} (in web/)", flush=True)
            rc = subprocess.call([npm, *step], cwd=WEB)
            if rc != 0:
                return self._fail(f"`npm {' '.join(step)}` in web/ failed (exit {rc}); its output is above")
        if _ui_state() is not None:
            return self._fail(f"`npm run build` in web/ did not write {os.path.relpath(BUILT[0], HERE)}")
        return None

    def _fail(self, msg: str) -> None:
        """Stop the build with one line; in editable mode only warn."""
        if self.editable_mode:  # the tree's own files are used; `make setup` builds them with npm
            print(f"aiprof: warning: {msg}", flush=True)
            return
        raise SystemExit(f"error: {msg}")


setup(cmdclass={"build_py": BuildPyWithUI})
