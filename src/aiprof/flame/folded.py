"""Folded stacks, the FlameGraph toolchain's input: ``frame;frame;frame weight`` per line.

A differential profile is written as ``stack base new`` (the format of FlameGraph's
``difffolded.pl``), which ``flamegraph.pl`` renders red/blue.
"""
from __future__ import annotations

from typing import IO, Iterable

import numpy as np

from aiprof.flame.profile import Profile, Stack, from_dict


def clean_frame(name: str) -> str:
    """A frame name safe in folded form: ``;`` separates frames and a line ends a record."""
    return name.replace(";", ":").replace("\n", " ").replace("\r", " ")


def lines(profile: Profile) -> Iterable[str]:
    """The folded lines of ``profile`` (no newline), in stack order."""
    base = profile.base
    for i, (s, w) in enumerate(zip(profile.stacks, profile.weights.tolist())):
        text = ";".join(clean_frame(f) for f in s)
        if base is None:
            if w:
                yield f"{text} {w}"
        else:
            yield f"{text} {int(base[i])} {w}"


def write(profile: Profile, f: IO[str]) -> int:
    """Write ``profile`` folded to a text stream; returns the number of lines."""
    n = 0
    for line in lines(profile):
        f.write(line + "\n")
        n += 1
    return n


def read(f: IO[str], name: str = "folded", unit: str = "nanoseconds") -> Profile:
    """Parse folded stacks (``stack weight``, or ``stack base new`` for a differential)."""
    single: dict[Stack, int] = {}
    pairs: dict[Stack, list[int]] = {}
    heads: list[tuple[str, int]] = []  # (text before the last number, weight) of every line
    for raw in f:
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        head, _, last = line.rpartition(" ")
        heads.append((head, int(last)))
        head2, _, mid = head.rpartition(" ")
        if mid.lstrip("-").isdigit() and head2:
            p = pairs.setdefault(_stack(head2), [0, 0])
            p[0] += int(mid)
            p[1] += int(last)
        else:
            key = _stack(head)
            single[key] = single.get(key, 0) + int(last)
    if pairs and not single:
        keys = sorted(pairs)
        return Profile(name, keys, np.array([pairs[k][1] for k in keys], dtype=np.int64), unit,
                       np.array([pairs[k][0] for k in keys], dtype=np.int64))
    # not every line has two counts: a plain file whose frames may end in a number
    plain: dict[Stack, int] = {}
    for head, w in heads:
        key = _stack(head)
        plain[key] = plain.get(key, 0) + w
    return from_dict(name, plain, unit)


def _stack(text: str) -> Stack:
    """Frames of a folded line; py-spy writes samples with no Python frame as an empty stack."""
    return tuple(f for f in text.split(";") if f) or ("[no frames]",)
