"""External programs aiprof runs, found the same way by every part that runs them."""
from __future__ import annotations

import os
import shutil
import sys

from aiprof.errors import AiprofError


def find_py_spy() -> str:
    """Path of the py-spy executable (PATH, or beside this interpreter); AiprofError if none."""
    cand = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if cand and os.path.exists(cand):
        return cand
    raise AiprofError("py-spy not found: pip install py-spy (or pip install 'aiprof[agent]')")
