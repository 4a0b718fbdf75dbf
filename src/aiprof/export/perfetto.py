"""Perfetto protobuf trace (``.pftrace``) of a capture: opens in ui.perfetto.dev.

Layout: one process track per rank ("rank 0 · host"), under it one track per host thread
(Python frames, torch ops, annotations, CUDA calls, nested), one per GPU stream (kernels,
memcpy/memset), GPU-side annotations, "steps" slices, a "findings" track of causes, and counter tracks
(CUDA caching-allocator totals from ``[memory]`` events; hardware counters when the store has
a ``hw`` table; the GPU's PM counters, one track per counter, from a ``pm`` table). Each CUDA launch has a flow arrow to the GPU work it launched.

Descriptors and interned names are written with the ``perfetto`` package's generated protobuf
classes; the (many) slice and counter packets are laid out with numpy
(:mod:`aiprof.export.protobuf`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Iterator, Optional

import numpy as np

from aiprof.errors import AiprofError
from aiprof.export import protobuf as pb
from aiprof.export.files import atomic_open
from aiprof.export.timeline import Mark, Timeline, build_timeline
from aiprof.trace.store import Capture

SEQ_ID = 1
_BEGIN, _END, _COUNTER = 1, 2, 4
_NEEDS_STATE = 2


def _pb2():
    try:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2
    except ImportError:  # pragma: no cover - depends on the environment
        raise AiprofError("the Perfetto export needs the 'perfetto' package: pip install 'aiprof[export]' "
                          "(or use --format chrome)") from None
    return perfetto_trace_pb2


@dataclass
class PerfettoStats:
    """What was written (for the CLI summary and tests)."""

    slices: dict[str, int]
    counters: int
    tracks: int
    bytes: int
    clipped: int


def _header(tl: Timeline, p) -> bytes:
    trace = p.Trace()
    first = trace.packet.add()
    first.trusted_packet_sequence_id = SEQ_ID
    first.sequence_flags = p.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    if len(tl.start):
        first.timestamp = int(tl.start.min())
    for i, name in enumerate(tl.names):
        en = first.interned_data.event_names.add()
        en.iid = i + 1
        en.name = name
    procs: dict[int, int] = {}
    for r in tl.meta.get("ranks", []):
        pk = trace.packet.add()
        uuid = 1 + len(procs)
        pk.track_descriptor.uuid = uuid
        pk.track_descriptor.process.pid = r["rank"] + 1  # synthetic: host pids of two ranks may collide
        host = f" · {r['host']}" if r.get("host") else ""
        pids = f" · pid {','.join(map(str, r['pids']))}" if r.get("pids") else ""
        pk.track_descriptor.process.process_name = f"rank {r['rank']}{host}{pids}"
        procs[r["rank"]] = uuid
    base = 1 + len(procs)  # timeline uuids start above the process tracks
    for order, t in enumerate(tl.tracks):
        pk = trace.packet.add()
        pk.track_descriptor.uuid = base + t.uuid
        pk.track_descriptor.parent_uuid = procs[t.rank]
        pk.track_descriptor.name = t.name
        pk.track_descriptor.sibling_order_rank = order
    for c in tl.counters:
        pk = trace.packet.add()
        pk.track_descriptor.uuid = base + c.uuid
        pk.track_descriptor.parent_uuid = procs[c.rank]
        pk.track_descriptor.name = c.name
        if c.unit == "bytes":
            pk.track_descriptor.counter.unit = p.CounterDescriptor.UNIT_SIZE_BYTES
    return trace.SerializeToString()


def _events(tl: Timeline, base: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Slice begin/end and counter events, time-ordered, as encoded Trace.packet entries.

    Encoded ``chunk`` events at a time, so that the encoder's scratch memory stays bounded.
    """
    n = len(tl.start)
    ts = np.concatenate([tl.start, tl.end])
    typ = np.concatenate([np.full(n, _BEGIN), np.full(n, _END)])
    # at one instant: ends before begins; inner ends first, outer begins first
    sub = np.concatenate([tl.depth, -tl.depth])
    track = np.concatenate([tl.track, tl.track]) + base
    name = np.concatenate([tl.name + 1, np.zeros(n, np.int64)])
    fout = np.concatenate([tl.flow_out, np.zeros(n, np.int64)])
    fin = np.concatenate([tl.flow_in, np.zeros(n, np.int64)])
    value = np.zeros(2 * n)
    if tl.counters:
        cts = np.concatenate([c.ts for c in tl.counters])
        ts = np.concatenate([ts, cts])
        typ = np.concatenate([typ, np.full(len(cts), _COUNTER)])
        sub = np.concatenate([sub, np.zeros(len(cts), np.int64)])
        track = np.concatenate([track, np.concatenate([np.full(len(c.ts), base + c.uuid) for c in tl.counters])])
        name = np.concatenate([name, np.zeros(len(cts), np.int64)])
        fout = np.concatenate([fout, np.zeros(len(cts), np.int64)])
        fin = np.concatenate([fin, np.zeros(len(cts), np.int64)])
        value = np.concatenate([value, np.concatenate([c.value for c in tl.counters])])
    order = np.lexsort((track, sub, typ != _END, ts))
    ts, typ, track, name, fout, fin, value = (a[order] for a in (ts, typ, track, name, fout, fin, value))
    for lo in range(0, len(ts), chunk):
        sl = slice(lo, lo + chunk)
        yield _encode(ts[sl], typ[sl], track[sl], name[sl], fout[sl], fin[sl], value[sl])


def _encode(ts, typ, track, name, fout, fin, value) -> bytes:
    m = len(ts)
    te = [
        pb.Field(9, pb.VARINT, typ.astype(np.uint64)),
        pb.Field(10, pb.VARINT, name.astype(np.uint64), name > 0),
        pb.Field(11, pb.VARINT, track.astype(np.uint64)),
        pb.Field(44, pb.FIXED64, pb.f64(value), typ == _COUNTER),
        pb.Field(47, pb.FIXED64, fout.astype(np.uint64), fout > 0),
        pb.Field(48, pb.FIXED64, fin.astype(np.uint64), fin > 0),
    ]
    packet = [
        pb.Field(8, pb.VARINT, pb.u64(ts)),
        pb.Field(10, pb.VARINT, np.full(m, SEQ_ID, np.uint64)),
        pb.Field(11, pb.BYTES, sub=te),
        pb.Field(13, pb.VARINT, np.full(m, _NEEDS_STATE, np.uint64)),
    ]
    return pb.encode(m, [pb.Field(1, pb.BYTES, sub=packet)])[0].tobytes()


def write(tl: Timeline, f: IO[bytes]) -> PerfettoStats:
    """Write a timeline as a Perfetto protobuf trace to a binary stream."""
    p = _pb2()
    head = _header(tl, p)
    base = 1 + len(tl.meta.get("ranks", []))
    f.write(head)
    size = len(head)
    for part in _events(tl, base):
        f.write(part)
        size += len(part)
    return PerfettoStats(tl.count_by_source(), int(sum(len(c.ts) for c in tl.counters)),
                         len(tl.tracks) + len(tl.counters), size, tl.clipped)


def export(capture: Capture, path: str, marks: Optional[list[Mark]] = None, host: bool = True) -> PerfettoStats:
    """Export ``capture`` to ``path`` (written whole or not at all)."""
    _pb2()  # fail before doing the work when the package is missing
    tl = build_timeline(capture, marks=marks, host=host)
    with atomic_open(path, "wb") as f:
        return write(tl, f)
