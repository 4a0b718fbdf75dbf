"""Output files that appear whole or not at all: write to a temporary file, then rename."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator

from aiprof.errors import AiprofError


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path``; it replaces ``path`` only if the block succeeds."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise AiprofError(f"{path}: the output folder {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".aiprof-", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise AiprofError(f"{path}: cannot write here ({exc.strerror})") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
