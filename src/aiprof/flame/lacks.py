"""What a capture lacks for a graph or a timeline, and which capture option records it.

The flame and export verbs say this instead of writing an empty graph: a CPU-only run has no
GPU work to draw, a capture made without ``--what python`` has no Python frames above the ops.
"""
from __future__ import annotations

from typing import Optional

from aiprof.trace.store import Capture, RankTrace

GPU_TABLES = ("kernels", "memops")
HOST_TABLES = ("python", "ops", "annotations", "runtime")


def _rows(ranks: list[RankTrace], tables: tuple[str, ...]) -> int:
    return sum(len(rt.table(t)) for rt in ranks for t in tables)


def _ranks(capture: Capture, rank: Optional[int]) -> list[RankTrace]:
    return [rt for rt in capture.ranks if rank is None or rt.rank == rank]


def empty_graph_reason(capture: Capture, what: str, rank: Optional[int] = None, step: Optional[int] = None) -> str:
    """Why the ``what`` ("gpu" or "cpu") graph of ``capture`` came out with no stacks: what the
    capture (or the rank, or the step) lacks and what records or draws it instead."""
    ranks = _ranks(capture, rank)
    whose = "the capture" if rank is None else f"rank {rank}"
    if what == "gpu":
        if not _rows(ranks, GPU_TABLES):
            return (f"{whose} has no GPU work (kernels, copies): a CPU-only run, or one recorded without CUDA "
                    "activity (aiprof run/attach --what kernels records it); --what cpu draws the host time instead")
        return f"no GPU work was launched in step {step} of {whose}" if step is not None else \
            f"{whose}'s GPU work has no duration"
    if not _rows(ranks, HOST_TABLES):
        return (f"{whose} has no host events (torch ops, Python functions): record them with "
                "aiprof run/attach --what kernels,python")
    return f"no host time in step {step} of {whose}" if step is not None else f"{whose}'s host events have no duration"


PYTHON_NOTE = ("no Python frames in the capture (recorded without --what python): {where} start at the torch "
               "ops; aiprof run/attach --what kernels,python adds them")


def python_note(capture: Capture, where: str) -> Optional[str]:
    """A sentence when the capture has host events but no Python frames (``where``: what starts at
    the ops: "stacks", "host tracks"), else None."""
    ranks = capture.ranks
    if _rows(ranks, ("python",)) or not _rows(ranks, HOST_TABLES):
        return None
    return PYTHON_NOTE.format(where=where)


def timeline_notes(capture: Capture, host: bool = True) -> list[str]:
    """What a timeline export of ``capture`` will be missing, one sentence each (empty: nothing)."""
    notes = []
    if not _rows(capture.ranks, GPU_TABLES):
        notes.append("no GPU work in the capture (a CPU-only run): no GPU stream tracks and no launch → kernel "
                     "arrows")
    py = python_note(capture, "host tracks") if host else None
    if py:
        notes.append(py)
    return notes


def timeline_empty_reason(capture: Capture, host: bool) -> Optional[str]:
    """A reason when a timeline export would hold no slice at all, else None."""
    if _rows(capture.ranks, GPU_TABLES) or (host and _rows(capture.ranks, HOST_TABLES)):
        return None
    if not host:
        return ("the capture has no GPU work (a CPU-only run) and --no-host drops the host tracks: "
                "nothing to export; leave out --no-host")
    return "the capture has no events to export (no GPU work, no host events)"
