"""Accumulates a table's rows chunk by chunk as numpy pieces, strings dictionary-encoded."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from aiprof.trace.table import Strings, Table


class Index(dict):
    """Label -> code, codes given in order of first appearance (a missing label gets the next one).

    ``np.fromiter(map(index.__getitem__, values))`` encodes a column in C; Python runs only for
    a label not seen before (``__missing__``), and a column has few distinct labels.
    """

    def __missing__(self, label: str) -> int:
        code = self[label] = len(self)
        return code


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass
class Columns:
    """Accumulates the rows of one table across chunks as per-chunk numpy pieces."""

    numeric: dict[str, list[np.ndarray]] = field(default_factory=dict)
    strings: dict[str, tuple[Index, list[np.ndarray]]] = field(default_factory=dict)
    rows: int = 0

    def add_num(self, name: str, values, dtype) -> None:
        self.numeric.setdefault(name, []).append(np.asarray(values, dtype=dtype))

    def add_str(self, name: str, values: Sequence[str]) -> None:
        """Append a chunk of a string column, encoded against the column's labels so far."""
        index, parts = self.strings.setdefault(name, (Index(), []))
        parts.append(np.fromiter(map(index.__getitem__, values), np.int32, len(values)))

    def add_same_str(self, name: str, value: str, n: int) -> None:
        """Append ``n`` rows that all hold ``value``."""
        index, parts = self.strings.setdefault(name, (Index(), []))
        parts.append(np.full(n, index[value], np.int32))

    def add_coded(self, name: str, codes: np.ndarray, labels: list[str]) -> None:
        """Append rows given as codes into ``labels``: what ``add_str([labels[c] for c in codes])``
        appends (labels new to the column registered in order of first appearance), in numpy."""
        index, parts = self.strings.setdefault(name, (Index(), []))
        remap = np.zeros(max(len(labels), 1), np.int32)
        used, first = np.unique(codes, return_index=True)
        for c in used[np.argsort(first)].tolist():
            remap[c] = index[labels[c]]
        parts.append(remap[codes])

    def extend(self, other: Columns) -> None:
        """Append ``other``'s rows (columns of the same names), re-coding its string labels.

        Each of ``other``'s columns becomes one piece here: a chunk's batches arrive as many
        small pieces, and fewer, larger ones keep a worker's pickled result and the final
        concatenation cheap.
        """
        for name, parts in other.numeric.items():
            self.numeric.setdefault(name, []).append(_joined(parts))
        for name, (oindex, oparts) in other.strings.items():
            index, parts = self.strings.setdefault(name, (Index(), []))
            remap = np.array([index[label] for label in oindex] or [0], dtype=np.int32)
            parts.append(remap[_joined(oparts)])
        self.rows += other.rows

    def table(self, sort_key: str = "ts") -> Table:
        """The accumulated rows, sorted by ``sort_key`` (stable) so row order never depends on chunking."""
        cols: dict[str, np.ndarray | Strings] = {}
        for name, parts in self.numeric.items():
            cols[name] = np.concatenate(parts) if parts else np.zeros(0)
        for name, (index, parts) in self.strings.items():
            cols[name] = Strings(np.concatenate(parts) if parts else np.zeros(0, np.int32), list(index))
        t = Table(cols)
        if sort_key in cols and len(t) > 1:
            key = cols[sort_key]
            if np.any(key[1:] < key[:-1]):
                t = t.take(np.argsort(key, kind="stable"))
        return t

