"""aiprof's Python API (docs/api.md): ``aiprof.open(paths)`` returns a :class:`Capture` whose
tables convert with ``.to_pandas()`` / ``.to_arrow()`` and whose ``report()`` is typed objects.

It sits on top of every other layer and only reads their public functions' results.
"""
from aiprof.api.capture import Capture, open
from aiprof.api.frame import PANDAS_MISSING, Frame, unit_of
from aiprof.api.report import (
    Baseline,
    CaptureInfo,
    Cause,
    Claim,
    Explained,
    KernelStat,
    Place,
    RankReport,
    Record,
    Report,
    Saving,
    Step,
    Symptom,
)

__all__ = ["PANDAS_MISSING", "Baseline", "Capture", "CaptureInfo", "Cause", "Claim", "Explained", "Frame",
           "KernelStat", "Place", "RankReport", "Record", "Report", "Saving", "Step", "Symptom", "open", "unit_of"]
