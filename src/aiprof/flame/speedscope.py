"""speedscope JSON (https://www.speedscope.app/file-format-schema.json): one "sampled" profile
per flame graph, each distinct stack a sample whose weight is its time (or sample count)."""
from __future__ import annotations

from typing import Sequence

from aiprof import __version__
from aiprof.flame.profile import Profile

SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def document(profiles: Sequence[Profile], name: str = "aiprof") -> dict:
    """The speedscope file for ``profiles`` (frames shared between them)."""
    frames: list[dict] = []
    index: dict[str, int] = {}
    out = []
    for p in profiles:
        samples, weights = [], []
        for s, w in zip(p.stacks, p.weights.tolist()):
            if w <= 0:
                continue
            samples.append([index.setdefault(f, len(index)) for f in s])
            weights.append(int(w))
        out.append({"type": "sampled", "name": p.name, "unit": "none" if p.unit == "samples" else p.unit,
                    "startValue": 0, "endValue": int(sum(weights)), "samples": samples, "weights": weights})
    frames = [{"name": f} for f in index]
    return {"$schema": SCHEMA, "name": name, "exporter": f"aiprof {__version__}", "activeProfileIndex": 0,
            "shared": {"frames": frames}, "profiles": out}
