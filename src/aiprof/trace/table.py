"""A minimal columnar table: numpy columns, strings dictionary-encoded.

Every analysis reads these. Strings are kept as integer codes into a label list so that
grouping by name is integer work (``np.bincount`` on codes) and a 10 M-row table does not
hold 10 M Python strings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa


@dataclass
class Strings:
    """A dictionary-encoded string column: ``labels[codes[i]]`` is row i's value."""

    codes: np.ndarray  # int32
    labels: list[str]

    def values(self) -> np.ndarray:
        """Decode to an object array of str (allocates; prefer working on codes)."""
        lab = np.array(self.labels + [""], dtype=object)
        return lab[self.codes]

    def isin_labels(self, pred) -> np.ndarray:
        """Boolean row mask: rows whose label satisfies ``pred``."""
        ok = np.zeros(len(self.labels) + 1, dtype=bool)
        for i, s in enumerate(self.labels):
            ok[i] = bool(pred(s))
        return ok[self.codes]


@dataclass
class Table:
    """Named columns of equal length: numpy arrays, or :class:`Strings` for text."""

    columns: dict[str, np.ndarray | Strings] = field(default_factory=dict)

    def __len__(self) -> int:
        for col in self.columns.values():
            return len(col.codes) if isinstance(col, Strings) else len(col)
        return 0

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def __getitem__(self, name: str) -> np.ndarray:
        """A numeric column, or a string column decoded to an object array."""
        col = self.columns[name]
        return col.values() if isinstance(col, Strings) else col

    def strings(self, name: str) -> Strings:
        """A string column in its encoded form."""
        col = self.columns[name]
        if not isinstance(col, Strings):
            raise TypeError(f"column {name!r} is not a string column")
        return col

    def names(self) -> list[str]:
        return list(self.columns)

    def take(self, index: np.ndarray) -> "Table":
        """Rows selected by an integer index or a boolean mask (labels are shared)."""
        out: dict[str, np.ndarray | Strings] = {}
        for k, col in self.columns.items():
            if isinstance(col, Strings):
                out[k] = Strings(col.codes[index], col.labels)
            else:
                out[k] = col[index]
        return Table(out)

    def rows(self, limit: int | None = None) -> Iterator[dict]:
        """Rows as dicts (for small tables and tests)."""
        decoded = {k: self[k] for k in self.columns}
        n = len(self) if limit is None else min(limit, len(self))
        for i in range(n):
            yield {k: _py(v[i]) for k, v in decoded.items()}

    # --- arrow conversion (the on-disk form is Parquet) ---
    def to_arrow(self) -> pa.Table:
        arrays, names = [], []
        for k, col in self.columns.items():
            if isinstance(col, Strings):
                arr = pa.DictionaryArray.from_arrays(_codes_to_arrow(col.codes), _labels_to_arrow(col.labels))
            else:
                arr = _to_arrow(col)
            arrays.append(arr)
            names.append(k)
        return pa.Table.from_arrays(arrays, names=names)

    @classmethod
    def from_arrow(cls, t: pa.Table) -> "Table":
        cols: dict[str, np.ndarray | Strings] = {}
        for name in t.column_names:
            chunked = t.column(name)
            if pa.types.is_dictionary(chunked.type):
                chunked = chunked.unify_dictionaries() if chunked.num_chunks > 1 else chunked
                if chunked.num_chunks == 0:
                    cols[name] = Strings(np.zeros(0, np.int32), [])
                    continue
                labels = chunked.chunk(0).dictionary.to_pylist()
                codes = np.concatenate([_from_arrow(c.indices, True) for c in chunked.chunks]).astype(np.int32)
                cols[name] = Strings(codes, labels)
            elif pa.types.is_string(chunked.type) or pa.types.is_large_string(chunked.type):
                cols[name] = encode_strings(chunked.to_pylist())
            elif chunked.num_chunks == 1:
                cols[name] = _from_arrow(chunked.chunk(0), False)
            else:
                cols[name] = chunked.to_numpy()
        return cls(cols)


# Columns cross to and from Arrow through their buffers where pyarrow would take the same path
# itself: pa.array and Array/ChunkedArray.to_numpy import pandas when it is installed (about
# 0.4 CPU-s, once per process: in a fresh Ray worker, more than a rank's ingest itself). Other
# columns (a dtype or a layout not listed here, nulls) take pyarrow's own conversion.
_NUMERIC_KINDS = "iuf"  # numpy dtype kinds stored as Arrow's fixed-width primitives
_MAX_UTF8_BYTES = (1 << 31) - 1  # Arrow's string type: int32 offsets


def _to_arrow(col: np.ndarray) -> pa.Array:
    """``pa.array(col)`` for a numeric or bool column (the same array), without its pandas check."""
    if col.ndim != 1 or not col.dtype.isnative:
        return pa.array(col)
    if col.dtype.kind in _NUMERIC_KINDS:
        return pa.Array.from_buffers(pa.from_numpy_dtype(col.dtype), len(col),
                                     [None, pa.py_buffer(np.ascontiguousarray(col))])
    if col.dtype.kind == "b":  # Arrow's booleans are bits, least significant first
        return pa.Array.from_buffers(pa.bool_(), len(col), [None, pa.py_buffer(np.packbits(col, bitorder="little"))])
    return pa.array(col)


def _codes_to_arrow(codes: np.ndarray) -> pa.Array:
    """``pa.array(codes, pa.int32())``: a dictionary column's indices."""
    return _to_arrow(codes) if codes.dtype == np.int32 else pa.array(codes, pa.int32())


def _labels_to_arrow(labels: list[str]) -> pa.Array:
    """``pa.array(labels, pa.string())``: a dictionary column's labels as UTF-8 and offsets."""
    try:
        data = [s.encode() for s in labels]
    except (AttributeError, UnicodeEncodeError):  # not a str, or a lone surrogate: pyarrow says what
        return pa.array(labels, pa.string())
    offsets = np.zeros(len(data) + 1, np.int64)
    np.cumsum([len(b) for b in data], out=offsets[1:])
    if offsets[-1] > _MAX_UTF8_BYTES:
        return pa.array(labels, pa.string())
    return pa.Array.from_buffers(pa.string(), len(data),
                                 [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))])


def _from_arrow(a: pa.Array, copy_ok: bool) -> np.ndarray:
    """``ChunkedArray.to_numpy()`` of a one-chunk column (the same dtype, values and flags: a
    read-only view of a numeric column, a new bool array). ``copy_ok``: the caller copies it
    anyway (any flags will do)."""
    t = a.type
    if a.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        return a.to_numpy(zero_copy_only=False) if copy_ok else pa.chunked_array([a]).to_numpy()
    buf = a.buffers()[1]
    if pa.types.is_boolean(t):
        bits = np.frombuffer(buf, np.uint8) if buf is not None else np.zeros(0, np.uint8)
        return np.unpackbits(bits, count=a.offset + len(a), bitorder="little")[a.offset:].astype(bool)
    dtype = np.dtype(t.to_pandas_dtype())
    if buf is None:
        return np.zeros(0, dtype) if copy_ok else pa.chunked_array([a]).to_numpy()
    return np.frombuffer(buf, dtype, len(a), a.offset * dtype.itemsize)


def encode_strings(values: Iterable[str | None]) -> Strings:
    """Dictionary-encode a sequence of strings (None becomes "")."""
    index: dict[str, int] = {}
    codes = [index.setdefault(v or "", len(index)) for v in values]
    return Strings(np.array(codes, dtype=np.int32), list(index))


def concat(tables: list[Table]) -> Table:
    """Concatenate tables with the same columns, re-encoding string columns to one dictionary."""
    tables = [t for t in tables if t.columns]
    if not tables:
        return Table()
    if len(tables) == 1:
        return tables[0]
    out: dict[str, np.ndarray | Strings] = {}
    for name, first in tables[0].columns.items():
        if isinstance(first, Strings):
            index: dict[str, int] = {}
            parts = []
            for t in tables:
                col = t.columns[name]
                remap = np.array([index.setdefault(s, len(index)) for s in col.labels] + [0], dtype=np.int32)
                parts.append(remap[col.codes])
            out[name] = Strings(np.concatenate(parts), list(index))
        else:
            out[name] = np.concatenate([t.columns[name] for t in tables])
    return Table(out)


def _py(v):
    if isinstance(v, np.generic):
        return v.item()
    return v
