"""Test helper: every cause a job-level detector returns, before the engine drops small ones."""
from __future__ import annotations

from types import ModuleType

from aiprof.pipeline import build_report


def report_and_job_causes(module: ModuleType, cap, monkeypatch) -> tuple[dict, list]:
    """``build_report(cap)`` with ``module.detect_job`` (which the engine calls) watched: the
    report, and every cause that detector returned."""
    got: list = []
    orig = module.detect_job

    def keep(*args):
        out = orig(*args)
        got.extend(out)
        return out
    monkeypatch.setattr(module, "detect_job", keep)
    return build_report(cap), got
