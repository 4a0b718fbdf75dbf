"""Test dependencies: skipped where one is missing, a failure in CI.

CI installs every test dependency from requirements/lock.txt, so a module missing there is a
broken set-up, never a reason to skip: a silent skip once hid every Ray test (a test folder named
``packaging`` shadowed the ``packaging`` module that Ray imports).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def need(module: str) -> ModuleType:
    """Import ``module`` for a test module or fixture; skip without it, fail in CI ($CI set)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{module} cannot be imported ({exc}); CI installs it from requirements/lock.txt",
                        pytrace=False)
        pytest.skip(f"could not import {module!r}: {exc}", allow_module_level=True)
