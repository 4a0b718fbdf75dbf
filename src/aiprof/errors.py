"""Errors that the CLI turns into one line on stderr and a non-zero exit code."""
from __future__ import annotations


class AiprofError(Exception):
    """A user-facing error: its message is printed as one line, without a traceback."""

    exit_code = 2


class TraceError(AiprofError):
    """A trace file that cannot be read: names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class UsageError(AiprofError):
    """Arguments that do not make sense together."""
