"""Chrome trace-event JSON of a capture (chrome://tracing, Perfetto's JSON importer, other tools).

Same tracks as the Perfetto export (:mod:`aiprof.export.timeline`): ranks are processes
(``pid`` = rank), each host thread and GPU stream a thread row, counters as ``"C"`` events.
Timestamps are µs with ns precision (three decimals). Written in chunks, encoded by msgspec.
"""
from __future__ import annotations

from typing import IO, Optional

import msgspec
import numpy as np

from aiprof.export.files import atomic_open
from aiprof.export.timeline import Mark, Timeline, build_timeline
from aiprof.trace.store import Capture

_CHUNK = 200_000
_ENC = msgspec.json.Encoder()


def write(tl: Timeline, f: IO[bytes]) -> int:
    """Write ``tl`` as Chrome JSON; returns the number of events written."""
    f.write(b'{"displayTimeUnit":"ns","traceEvents":[\n')
    meta = []
    tid_of = {}
    for i, t in enumerate(tl.tracks):
        tid_of[t.uuid] = i + 1
        meta.append({"ph": "M", "name": "thread_name", "pid": t.rank, "tid": i + 1, "args": {"name": t.name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": t.rank, "tid": i + 1, "args": {"sort_index": i}})
    for r in tl.meta.get("ranks", []):
        host = f" · {r['host']}" if r.get("host") else ""
        meta.append({"ph": "M", "name": "process_name", "pid": r["rank"], "args": {"name": f"rank {r['rank']}{host}"}})
    rank_of = {t.uuid: t.rank for t in tl.tracks}
    first = True
    count = 0

    def emit(events: list) -> None:
        nonlocal first, count
        if not events:
            return
        body = _ENC.encode(events)[1:-1]
        f.write((b"" if first else b",\n") + body)
        first = False
        count += len(events)

    emit(meta)
    names = tl.names
    order = np.lexsort((tl.depth, tl.start))
    sources = tl.sources
    for lo in range(0, len(order), _CHUNK):
        o = order[lo:lo + _CHUNK]
        evs = []
        for s, e, trk, nm, src, fo, fi in zip(tl.start[o].tolist(), tl.end[o].tolist(), tl.track[o].tolist(),
                                              tl.name[o].tolist(), tl.source[o].tolist(), tl.flow_out[o].tolist(),
                                              tl.flow_in[o].tolist()):
            ev = {"ph": "X", "name": names[nm], "cat": sources[src], "pid": rank_of[trk], "tid": tid_of[trk],
                  "ts": s / 1000.0, "dur": (e - s) / 1000.0}
            if fo or fi:
                ev["args"] = {"flow": fo or fi}
            evs.append(ev)
        emit(evs)
    for c in tl.counters:
        for lo in range(0, len(c.ts), _CHUNK):
            emit([{"ph": "C", "name": c.name, "pid": c.rank, "ts": t / 1000.0, "args": {"value": v}}
                  for t, v in zip(c.ts[lo:lo + _CHUNK].tolist(), c.value[lo:lo + _CHUNK].tolist())])
    f.write(b"\n]}\n")
    return count


def export(capture: Capture, path: str, marks: Optional[list[Mark]] = None, host: bool = True) -> int:
    """Export ``capture`` to ``path`` as Chrome JSON (``.gz`` suffix: gzip-compressed)."""
    tl = build_timeline(capture, marks=marks, host=host)
    with atomic_open(path, "wb") as raw:
        if path.endswith(".gz"):
            import gzip

            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=5) as gz:
                return write(tl, gz)
        return write(tl, raw)
