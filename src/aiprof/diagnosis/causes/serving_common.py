"""Helpers shared by the serving causes: the iterations' phases on the replay graph and the host
tree, and which engine runs the model (its remedies are named in its own terms)."""
from __future__ import annotations

import numpy as np

from aiprof.analysis.serving import DECODE, ServingAnalysis
from aiprof.diagnosis.facts import RankFacts

# At least this many decode iterations make a decode loop worth a serving cause.
MIN_DECODE_ITERATIONS = 3
CB, VLLM, GENERATE = "transformers continuous batching", "vLLM", "transformers generate"


def serving(f: RankFacts) -> ServingAnalysis | None:
    """The rank's serving analysis (None for training and non-LM traces)."""
    sv = f.extra.get("serving")
    return sv if isinstance(sv, ServingAnalysis) and sv.iterations else None


def phases(f: RankFacts) -> np.ndarray:
    """Phase of each of the rank's steps (its serving iterations)."""
    sv = serving(f)
    if sv is None or len(sv.iterations) != len(f.steps):
        return np.array([""] * len(f.steps), dtype=object)
    return np.array([it.phase for it in sv.iterations], dtype=object)


def step_mask(f: RankFacts, which: tuple[str, ...]) -> np.ndarray:
    """Steps whose phase is one of ``which``."""
    return np.isin(phases(f), which)


def nodes_in(f: RankFacts, steps: np.ndarray) -> np.ndarray:
    """Host-tree nodes that start inside the given steps (a step mask)."""
    if not len(f.tree):
        return np.zeros(0, dtype=bool)
    i = f.steps.index_of(f.tree.start)
    return (i >= 0) & steps[np.maximum(i, 0)]


def actions_in(f: RankFacts, steps: np.ndarray) -> np.ndarray:
    """Replay actions that start inside the given steps (a step mask)."""
    i = f.steps.index_of(f.graph.a_ts)
    return (i >= 0) & steps[np.maximum(i, 0)]


def decode_steps(f: RankFacts) -> np.ndarray | None:
    """Mask of decode iterations, or None when there are too few to be a decode loop."""
    m = step_mask(f, (DECODE,))
    return m if m.sum() >= MIN_DECODE_ITERATIONS else None


def gpu_decode_steps(f: RankFacts) -> np.ndarray | None:
    """:func:`decode_steps` of a rank that ran GPU work (None otherwise): where the decode causes act."""
    if not f.has_gpu or not f.graph.n_ops:
        return None
    return decode_steps(f)


def engine(f: RankFacts) -> str:
    """Which engine drives the model, from the frames the trace has ("" when unknown)."""
    labels = f.tree.labels
    if any("continuous_batching/" in s for s in labels):
        return CB
    if any(s.startswith("vllm/") or "/vllm/" in s for s in labels):
        return VLLM
    if any(s.startswith("transformers/generation/utils.py") for s in labels):
        return GENERATE
    return ""


def median_of(f: RankFacts, steps: np.ndarray, attr: str) -> float:
    """Median of a serving-iteration attribute (µs) over the given steps."""
    sv = serving(f)
    if sv is None:
        return 0.0
    v = [getattr(it, attr) for it, m in zip(sv.iterations, steps) if m]
    return float(np.median(v)) if v else 0.0
