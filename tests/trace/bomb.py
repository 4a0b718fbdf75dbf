"""Gzip bombs of valid Kineto events, written cheaply: one gzip member of MEMBER_BYTES of events,
compressed once and written again and again (gzip readers inflate concatenated members as one
stream), so a GiB of JSON costs a few MB of disk and well under a second."""
from __future__ import annotations

import gzip
from pathlib import Path

MEMBER_BYTES = 1 << 20
EVENT = (b'{"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.0, "dur": 2.0, '
         b'"args": {"device": 0, "stream": 7, "correlation": 1}}')


def write_bomb(path: Path, json_bytes: int) -> int:
    """A ``.json.gz`` trace holding at least ``json_bytes`` of JSON events; returns its JSON size."""
    per = MEMBER_BYTES // (len(EVENT) + 1)
    member = gzip.compress((EVENT + b",") * per, compresslevel=9)
    n = -(-json_bytes // (per * (len(EVENT) + 1)))
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(n):
            f.write(member)
        f.write(gzip.compress(EVENT + b"]}"))
    return n * per * (len(EVENT) + 1)
