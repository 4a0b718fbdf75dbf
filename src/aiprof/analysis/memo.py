"""Per-rank memo of derived structures (steps, the host tree, unions, samples): several analyses
of one rank ask for the same ones, which are built once and kept on the rank's trace object."""
from __future__ import annotations

from aiprof.trace.store import RankTrace


def analysis_cache(rt: RankTrace) -> dict:
    """The rank's memo (dropped with the rank object)."""
    return rt.__dict__.setdefault("_analysis_cache", {})
