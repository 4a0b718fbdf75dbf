"""JSON report writer (schema aiprof.report/2, documented in docs/report.md)."""
from __future__ import annotations

import json
import math
import os
import tempfile


def _clean(obj):
    """Replace NaN/inf (not valid JSON) with None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def dumps(report: dict) -> str:
    """The report as a JSON string."""
    return json.dumps(_clean(report), indent=1, default=str)


def write(report: dict, path: str) -> None:
    """Write atomically: a reader never sees a half-written report."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(report))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
