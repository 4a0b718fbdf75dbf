"""Helpers of the serving tests (not collected): the captures' truth and their ranks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"


def truth(captures: Path, mode: str) -> dict:
    return json.loads((captures / f"{mode}.truth.json").read_text())


def rank(captures: Path, mode: str, tmp: Path):
    """The capture's single rank, from a private copy (the store cache is written beside it)."""
    from aiprof.trace.store import open_capture

    dst = tmp / f"{mode}.json.gz"
    shutil.copy(captures / f"{mode}.json.gz", dst)
    return open_capture(str(dst), show_progress=False).ranks[0]


def fixture_rank(name: str, tmp: Path):
    from aiprof.trace.store import open_capture

    dst = tmp / Path(name).name
    shutil.copy(DATA / name, dst)
    return open_capture(str(dst), show_progress=False).ranks[0]
