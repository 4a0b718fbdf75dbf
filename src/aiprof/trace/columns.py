"""Accumulates a table's rows chunk by chunk as numpy pieces, strings dictionary-encoded."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from aiprof.trace.table import Strings, Table


@dataclass
class Columns:
    """Accumulates the rows of one table across chunks as per-chunk numpy pieces."""

    numeric: dict[str, list[np.ndarray]] = field(default_factory=dict)
    strings: dict[str, tuple[dict[str, int], list[np.ndarray]]] = field(default_factory=dict)
    rows: int = 0

    def add_num(self, name: str, values, dtype) -> None:
        self.numeric.setdefault(name, []).append(np.asarray(values, dtype=dtype))

    def add_str(self, name: str, values) -> None:
        # Encode the chunk in C (pyarrow), then map its few distinct labels to global codes.
        index, parts = self.strings.setdefault(name, ({}, []))
        enc = pa.array(values, pa.string()).dictionary_encode()
        remap = np.array([index.setdefault(s, len(index)) for s in enc.dictionary.to_pylist()] or [0], dtype=np.int32)
        parts.append(remap[enc.indices.to_numpy(zero_copy_only=False)])

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

