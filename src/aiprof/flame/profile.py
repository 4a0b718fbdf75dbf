"""A flame-graph profile: distinct stacks and their weights (ns), plus merge/diff/filter.

Every renderer (folded, SVG/HTML, speedscope) reads a :class:`Profile`; the builders in
:mod:`aiprof.flame.stacks` and the py-spy reader produce one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

Stack = tuple[str, ...]

GPU_PREFIX = "[gpu] "


@dataclass
class Profile:
    """Stacks (root first) with integer weights.

    ``base`` is set on a differential profile: the weight of each stack in the baseline
    (0 where the stack is new). ``unit`` is "nanoseconds" for traces, "samples" for py-spy.
    """

    name: str
    stacks: list[Stack]
    weights: np.ndarray  # int64, one per stack
    unit: str = "nanoseconds"
    base: Optional[np.ndarray] = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.weights = np.asarray(self.weights, dtype=np.int64)
        if len(self.weights) != len(self.stacks):
            raise ValueError("one weight per stack")

    @property
    def total(self) -> int:
        return int(self.weights.sum())

    @property
    def is_diff(self) -> bool:
        return self.base is not None

    def as_dict(self) -> dict[Stack, int]:
        out: dict[Stack, int] = {}
        for s, w in zip(self.stacks, self.weights.tolist()):
            out[s] = out.get(s, 0) + w
        return out

    def frame_totals(self) -> dict[str, int]:
        """Inclusive weight of every frame name (counted once per stack, recursion-safe)."""
        out: dict[str, int] = {}
        for s, w in zip(self.stacks, self.weights.tolist()):
            for f in set(s):
                out[f] = out.get(f, 0) + w
        return out

    def leaf_totals(self) -> dict[str, int]:
        """Weight of each leaf frame (for GPU graphs: each kernel name)."""
        out: dict[str, int] = {}
        for s, w in zip(self.stacks, self.weights.tolist()):
            if s:
                out[s[-1]] = out.get(s[-1], 0) + w
        return out

    def filter(self, pred) -> "Profile":
        """Stacks for which ``pred(stack)`` is true."""
        keep = [i for i, s in enumerate(self.stacks) if pred(s)]
        return Profile(self.name, [self.stacks[i] for i in keep], self.weights[keep], self.unit,
                       None if self.base is None else self.base[keep], dict(self.meta))

    def prefixed(self, *frames: str) -> "Profile":
        """Every stack under extra root frames (e.g. ``"rank 1"``)."""
        return Profile(self.name, [tuple(frames) + s for s in self.stacks], self.weights.copy(), self.unit,
                       None if self.base is None else self.base.copy(), dict(self.meta))


def from_dict(name: str, d: dict[Stack, int], unit: str = "nanoseconds", meta: Optional[dict] = None) -> Profile:
    """A profile from a stack -> weight mapping (zero weights dropped, stacks sorted)."""
    items = sorted((s, w) for s, w in d.items() if w)
    return Profile(name, [s for s, _ in items], np.array([w for _, w in items], dtype=np.int64), unit,
                   meta=dict(meta or {}))


def merge(profiles: Iterable[Profile], name: str = "merged") -> Profile:
    """Sum of profiles (same stacks add up)."""
    out: dict[Stack, int] = {}
    unit = "nanoseconds"
    for p in profiles:
        unit = p.unit
        for s, w in zip(p.stacks, p.weights.tolist()):
            out[s] = out.get(s, 0) + w
    return from_dict(name, out, unit)


def diff(base: Profile, new: Profile, name: str | None = None) -> Profile:
    """Differential profile: widths from ``new``, ``base`` weights kept for colouring.

    Stacks present only in the baseline are kept with weight 0 in ``weights`` so that
    what vanished is still listed (folded output) even though it has no width.
    """
    b, n = base.as_dict(), new.as_dict()
    keys = sorted(set(b) | set(n))
    return Profile(name or f"{new.name} vs {base.name}", keys,
                   np.array([n.get(k, 0) for k in keys], dtype=np.int64), new.unit,
                   np.array([b.get(k, 0) for k in keys], dtype=np.int64),
                   {"base": base.name, "new": new.name})
