"""Vectorised protobuf encoding of many small, same-shaped messages (Perfetto track events).

Building one Python protobuf object per event costs microseconds each; a 10 M-event capture
would spend minutes there. Slice and counter packets have a handful of scalar fields, so they
are laid out with numpy instead: per-message field lengths, a prefix sum for offsets, and one
scatter per field and varint byte. The bytes are exactly what the protobuf library would write
for the same fields (tests decode them with the perfetto package's generated classes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VARINT, FIXED64, BYTES = 0, 1, 2
_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def varint_len(v: np.ndarray) -> np.ndarray:
    """Encoded length (1..10 bytes) of each unsigned value."""
    return (1 + np.searchsorted(_LIMITS, np.asarray(v, dtype=np.uint64), side="right")).astype(np.int64)


def tag(field: int, wire: int) -> bytes:
    """The key bytes of a field (field number and wire type)."""
    v = (field << 3) | wire
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


@dataclass
class Field:
    """One field of every message: scalar values (uint64 bit patterns), or a nested message.

    ``present`` masks the messages that have the field. A BYTES field holds the nested
    message given by ``sub`` (its own fields), written in place: no intermediate buffers.
    """

    number: int
    kind: int  # VARINT, FIXED64, or BYTES (a nested message of ``sub`` fields)
    values: np.ndarray | None = None
    present: np.ndarray | None = None
    sub: list["Field"] | None = None

    def key(self) -> bytes:
        return tag(self.number, 2 if self.kind == BYTES else (1 if self.kind == FIXED64 else 0))


def _put_varint(buf: np.ndarray, pos: np.ndarray, v: np.ndarray) -> None:
    v = np.asarray(v, dtype=np.uint64)
    ln = varint_len(v)
    for k in range(int(ln.max()) if len(ln) else 0):
        m = ln > k
        byte = ((v[m] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= np.where(ln[m] - 1 > k, 0x80, 0).astype(np.uint8)
        buf[pos[m] + k] = byte


def _lengths(n: int, fields: list[Field]) -> tuple[np.ndarray, list]:
    """Per-message encoded length of ``fields`` and, per field, its lengths (and sub-lengths)."""
    total = np.zeros(n, dtype=np.int64)
    per = []
    for f in fields:
        sub = None
        if f.kind == VARINT:
            body = varint_len(f.values)
        elif f.kind == FIXED64:
            body = np.full(n, 8, dtype=np.int64)
        else:
            size, sub = _lengths(n, f.sub or [])
            body = varint_len(size.astype(np.uint64)) + size
            sub = (size, sub)
        ln = len(f.key()) + body
        if f.present is not None:
            ln = np.where(f.present, ln, 0)
        per.append((ln, sub))
        total += ln
    return total, per


def _write(buf: np.ndarray, cur: np.ndarray, fields: list[Field], per: list) -> None:
    cur = cur.copy()
    for f, (ln, sub) in zip(fields, per):
        on = ln > 0
        pos = cur[on]
        key = f.key()
        for i, b in enumerate(key):
            buf[pos + i] = b
        pos = pos + len(key)
        if f.kind == VARINT:
            _put_varint(buf, pos, np.asarray(f.values, dtype=np.uint64)[on])
        elif f.kind == FIXED64:
            raw = np.ascontiguousarray(np.asarray(f.values).astype("<u8", copy=False)[on]).view(np.uint8)
            for k in range(8):
                buf[pos + k] = raw[k::8]
        else:
            size, subper = sub
            _put_varint(buf, pos, size[on].astype(np.uint64))
            start = np.zeros(len(ln), dtype=np.int64)
            start[on] = pos + varint_len(size[on].astype(np.uint64))
            # nested fields are written at their own offsets; absent ones have zero length
            sub_fields = [Field(g.number, g.kind, g.values,
                                on if g.present is None else (g.present & on), g.sub) for g in f.sub or []]
            _, sp = _lengths(len(ln), sub_fields)
            _write(buf, start, sub_fields, sp)
        cur += ln


def encode(n: int, fields: list[Field]) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``n`` messages with ``fields`` (in field order); returns (buffer, offsets[n+1])."""
    total, per = _lengths(n, fields)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(total, out=offsets[1:])
    buf = np.zeros(int(offsets[-1]), dtype=np.uint8)
    _write(buf, offsets[:-1], fields, per)
    return buf, offsets


def u64(values: np.ndarray) -> np.ndarray:
    """Bit pattern of int64 values as uint64 (two's complement, as protobuf's int64 is)."""
    return np.asarray(values, dtype=np.int64).view(np.uint64)


def f64(values: np.ndarray) -> np.ndarray:
    """Bit pattern of float64 values as uint64 (for FIXED64 double fields)."""
    return np.asarray(values, dtype=np.float64).view(np.uint64)
