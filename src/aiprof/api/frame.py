"""One table of a capture as Arrow, convertible to pandas, with each column's unit in its schema.

A :class:`Frame` is what every table of :class:`aiprof.api.Capture` returns. It holds a
``pyarrow.Table`` (pyarrow is a dependency of aiprof, pandas is not): ``to_arrow()`` returns it,
``to_pandas()`` converts it. String columns are Arrow dictionaries (labels, shared by the rows),
decoded to plain strings by ``to_pandas()``. Units: docs/api.md ("Units").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from aiprof.trace.table import Strings, Table

if TYPE_CHECKING:  # pandas is optional: imported only by to_pandas()
    import pandas as pd

PANDAS_MISSING = "aiprof: to_pandas() needs pandas, which is not installed: pip install pandas"

# Columns of the store's tables (docs/metrics.md, "Tables") that hold a time or a size; derived
# tables carry their unit as a suffix of the column's name, as the JSON report does.
_UNIT_OF = {"ts": "ns", "dur": "ns", "t0": "ns", "t1": "ns", "src_ts": "ns", "dst_ts": "ns",
            "bytes": "bytes", "smem": "bytes", "total_allocated": "bytes", "total_reserved": "bytes",
            "percentage": "%"}
_SUFFIXES = (("_us", "us"), ("_ns", "ns"), ("_pctg", "%"), ("_pct", "%"), ("_bytes", "bytes"), ("_gbps", "GB/s"))


def unit_of(column: str) -> str:
    """The unit of a column of any aiprof table ("" when it has none: a count, a name, a code)."""
    if column in _UNIT_OF:
        return _UNIT_OF[column]
    for suffix, unit in _SUFFIXES:
        if column.endswith(suffix):
            return unit
    return ""


def _field(name: str, typ: pa.DataType) -> pa.Field:
    unit = unit_of(name)
    return pa.field(name, typ, metadata={"unit": unit} if unit else None)


def _strings(col: Strings) -> pa.DictionaryArray:
    labels = col.labels
    # a code one past the labels is the empty string (Strings.values): give it a label of its own
    if len(col.codes) and int(col.codes.max()) >= len(labels):
        labels = labels + [""]
    return pa.DictionaryArray.from_arrays(pa.array(col.codes, pa.int32()), pa.array(labels, pa.string()))


def arrow_table(t: Table, rank: int | None = None) -> pa.Table:
    """A store table as Arrow (numeric columns without a copy), ``rank`` as a first column when given."""
    fields, arrays = [], []
    if rank is not None:
        fields.append(_field("rank", pa.int32()))
        arrays.append(pa.array(np.full(len(t), rank, np.int32)))
    for name, col in t.columns.items():
        arr = _strings(col) if isinstance(col, Strings) else pa.array(col)
        fields.append(_field(name, arr.type))
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def arrow_rows(rows: Sequence[Mapping], columns: Iterable[str]) -> pa.Table:
    """Rows of a derived table (steps, breakdowns) as Arrow, in the order of ``columns``."""
    arrays = {c: pa.array([r.get(c) for r in rows]) for c in columns}
    return pa.Table.from_arrays(list(arrays.values()), schema=pa.schema([_field(c, a.type) for c, a in arrays.items()]))


def _pandas():
    try:
        import pandas
    except ImportError:
        raise ImportError(PANDAS_MISSING) from None
    return pandas


class Frame:
    """A table: ``to_arrow()`` / ``to_pandas()``; ``units`` maps each column with a unit to it."""

    def __init__(self, name: str, table: pa.Table) -> None:
        self.name = name
        self._table = table

    @classmethod
    def concat(cls, name: str, tables: Sequence[pa.Table]) -> "Frame":
        """One frame of several ranks' tables (same columns): their dictionaries unified."""
        if len(tables) == 1:
            return cls(name, tables[0])
        return cls(name, pa.concat_tables(tables, promote_options="default").unify_dictionaries())

    @property
    def columns(self) -> list[str]:
        return list(self._table.column_names)

    @property
    def units(self) -> dict[str, str]:
        """Column -> unit ("ns", "us", "%", "bytes", "GB/s") for the columns that have one."""
        out = {}
        for f in self._table.schema:
            if f.metadata and b"unit" in f.metadata:
                out[f.name] = f.metadata[b"unit"].decode()
        return out

    def __len__(self) -> int:
        return self._table.num_rows

    def __repr__(self) -> str:
        units = ", ".join(f"{c} [{u}]" for c, u in self.units.items())
        return f"<aiprof Frame {self.name!r}: {len(self)} rows; columns {', '.join(self.columns)}; units: {units or 'none'}>"

    def to_arrow(self) -> pa.Table:
        """The table as a ``pyarrow.Table`` (string columns dictionary-encoded; units in field metadata)."""
        return self._table

    def to_pandas(self, categorical: bool = False) -> "pd.DataFrame":
        """The table as a pandas DataFrame: string columns as strings (``categorical=True``: as
        pandas categoricals, smaller for large tables); ``df.attrs["units"]`` holds the units.
        Raises ImportError naming ``pip install pandas`` when pandas is not installed."""
        _pandas()
        t = self._table
        if not categorical:
            for i, f in enumerate(t.schema):
                if pa.types.is_dictionary(f.type):
                    t = t.set_column(i, f.with_type(f.type.value_type), pc.cast(t.column(i), f.type.value_type))
        df = t.to_pandas()
        df.attrs["units"] = self.units
        return df
