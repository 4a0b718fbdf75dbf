"""The JSON report writer: valid JSON whatever the analysis put in, the same document as the
standard library's reading of it, written atomically."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from aiprof.report import json_report


def test_values_json_has_no_type_for():
    """NaN and infinities become null (JSON has neither); numpy scalars their Python value; other
    objects their text; non-ASCII names are kept as they are."""
    doc = {"nan": math.nan, "inf": -math.inf, "np_nan": np.float64("nan"), "f32": np.float32(2.5),
           "i64": np.int64(7), "flag": np.bool_(True), "tuple": (1, 2), "path": _Named("ab"),
           "name": "Ω_kernel<float>", 3: "int key"}
    out = json.loads(json_report.dumps(doc))
    assert out == {"nan": None, "inf": None, "np_nan": None, "f32": 2.5, "i64": 7, "flag": True,
                   "tuple": [1, 2], "path": "named ab", "name": "Ω_kernel<float>", "3": "int key"}


def test_same_document_as_the_standard_library(ddp2_dir):
    """A real report, encoded, parses to what the standard library's encoding of it parses to
    (with non-finite values nulled, as the writer did before it used msgspec)."""
    from aiprof.pipeline import build_report
    from aiprof.trace.store import open_capture

    rep = build_report(open_capture([str(p) for p in sorted(ddp2_dir.glob("*.json.gz"))]))
    theirs = json.loads(json.dumps(_nulled(rep), default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))
    assert json.loads(json_report.dumps(rep)) == theirs and theirs["ranks"]


def _nulled(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _nulled(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nulled(v) for v in obj]
    return obj


def test_write_is_atomic_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "r" / "report.json"
    json_report.write({"a": 1}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}

    class Boom:
        def __str__(self) -> str:
            raise RuntimeError("cannot say")

    with pytest.raises(RuntimeError):
        json_report.write({"a": Boom()}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}  # the earlier report, whole
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"named {self.name}"
