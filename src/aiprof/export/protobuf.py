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
    """One scalar field of every message: values (uint64 bit patterns) where ``present``."""

    number: int
    kind: int  # VARINT, FIXED64, or BYTES (a nested message encoded by :func:`encode`)
    values: np.ndarray
    present: np.ndarray | None = None
    # for BYTES: the nested messages' buffer and offsets (from :func:`encode`)
    nested: tuple[np.ndarray, np.ndarray] | None = None

    def lengths(self, n: int) -> np.ndarray:
        key = len(tag(self.number, 2 if self.kind == BYTES else (1 if self.kind == FIXED64 else 0)))
        if self.kind == VARINT:
            body = varint_len(self.values)
        elif self.kind == FIXED64:
            body = np.full(n, 8, dtype=np.int64)
        else:
            size = np.diff(self.nested[1])
            body = varint_len(size.astype(np.uint64)) + size
        ln = key + body
        return ln if self.present is None else np.where(self.present, ln, 0)


def _put_varint(buf: np.ndarray, pos: np.ndarray, v: np.ndarray) -> None:
    v = np.asarray(v, dtype=np.uint64)
    ln = varint_len(v)
    for k in range(int(ln.max()) if len(ln) else 0):
        m = ln > k
        byte = ((v[m] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= np.where(ln[m] - 1 > k, 0x80, 0).astype(np.uint8)
        buf[pos[m] + k] = byte


def encode(n: int, fields: list[Field]) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``n`` messages with ``fields`` (in field order); returns (buffer, offsets[n+1])."""
    lens = [f.lengths(n) for f in fields]
    total = np.zeros(n, dtype=np.int64)
    for ln in lens:
        total += ln
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(total, out=offsets[1:])
    buf = np.zeros(int(offsets[-1]), dtype=np.uint8)
    cur = offsets[:-1].copy()
    for f, ln in zip(fields, lens):
        wire = 2 if f.kind == BYTES else (1 if f.kind == FIXED64 else 0)
        key = np.frombuffer(tag(f.number, wire), dtype=np.uint8)
        on = ln > 0
        pos = cur[on]
        for i, b in enumerate(key):
            buf[pos + i] = b
        pos = pos + len(key)
        if f.kind == VARINT:
            _put_varint(buf, pos, np.asarray(f.values, dtype=np.uint64)[on])
        elif f.kind == FIXED64:
            raw = np.ascontiguousarray(np.asarray(f.values)[on]).view(np.uint8).reshape(-1, 8)
            buf[(pos[:, None] + np.arange(8)).ravel()] = raw.ravel()
        else:
            nbuf, noff = f.nested
            size = np.diff(noff)[on]
            _put_varint(buf, pos, size.astype(np.uint64))
            pos = pos + varint_len(size.astype(np.uint64))
            _copy_ranges(buf, pos, nbuf, noff[:-1][on], size)
        cur += ln
    return buf, offsets


def _copy_ranges(dst: np.ndarray, dst_pos: np.ndarray, src: np.ndarray, src_pos: np.ndarray, size: np.ndarray) -> None:
    """dst[dst_pos[i]:+size[i]] = src[src_pos[i]:+size[i]] for all i, without a Python loop."""
    if not len(size) or int(size.sum()) == 0:
        return
    starts = np.repeat(np.cumsum(size) - size, size)
    within = np.arange(int(size.sum())) - starts
    dst[np.repeat(dst_pos, size) + within] = src[np.repeat(src_pos, size) + within]


def u64(values: np.ndarray) -> np.ndarray:
    """Bit pattern of int64 values as uint64 (two's complement, as protobuf's int64 is)."""
    return np.asarray(values, dtype=np.int64).view(np.uint64)


def f64(values: np.ndarray) -> np.ndarray:
    """Bit pattern of float64 values as uint64 (for FIXED64 double fields)."""
    return np.asarray(values, dtype=np.float64).view(np.uint64)
