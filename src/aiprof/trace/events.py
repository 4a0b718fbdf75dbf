"""The part of a Kineto trace event that aiprof decodes, as msgspec structs.

An event's ``args`` stay raw (``msgspec.Raw``) in the first pass; each event kind's handler then
decodes the args of all its events in one call with a small struct of just the fields it reads
(``decode_args``). Unknown fields are skipped in C. Old and new arg names are both listed
(``External id``/``external id``, ``correlation``/``correlation id``, ...).

A field whose column has a fixed value for "absent" (-1 for ids and counts, NaN for measures)
has that value as its default, so that the builder turns a list of them into a numpy column in
one C call; such a field is still ``Optional`` and a JSON ``null`` in it decodes to None, which
the builder maps to the same value (``builder._ints``). Fields with a fallback (``ext_old``,
``corr_old``, ``device``, ``stream``, the old message sizes) keep None, which marks "absent".
"""
from __future__ import annotations

import re
from typing import Annotated, Optional, Union

import msgspec
from msgspec import Meta, Raw

# Integers land in int64 columns (regs in int32), floats in float32 ones: a value outside is a
# bad event (EventError), never an overflow deep in numpy.
I64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
I32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
F32 = Annotated[float, Meta(ge=-3.4e38, le=3.4e38)]
MISSING = float("nan")  # JSON has no NaN, so a NaN time means the event had no such field


class EventError(Exception):
    """An event that the reader cannot use: which one, which field, what is wrong with it.

    ``index`` counts events from the start of the builder that raised it (the trace reader adds
    the events before it); ``event`` is the decoded event when there is one.
    """

    def __init__(self, index: int, field: str, problem: str, event: Ev | None = None) -> None:
        super().__init__(problem)
        self.index = index
        self.field = field
        self.problem = problem
        self.event = event

    def describe(self, offset: int = 0) -> str:
        """One line: ``traceEvents[N] (ph X, cat kernel, name "..."): problem``."""
        e = self.event
        what = ""
        if e is not None:
            name = e.name if len(e.name) <= 60 else e.name[:59] + "…"
            what = f" (ph {e.ph or '?'}, cat {e.cat or '?'}, name {name!r})"
        return f"traceEvents[{self.index + offset}]{what}: {self.problem}"


_AT = re.compile(r"^(.*?)(?: - at `\$\[(\d+)\]\.?(.*)`)?$", re.DOTALL)


def validation_error(exc: msgspec.ValidationError, prefix: str = "", evs: list[Ev] | None = None) -> EventError:
    """An EventError from msgspec's "... - at `$[i].field`" (``prefix``: where the decoded part sits)."""
    m = _AT.match(str(exc))
    msg, idx, field = (m.group(1), m.group(2), m.group(3)) if m else (str(exc), None, "")
    i = int(idx) if idx is not None else 0
    field = ".".join(p for p in (prefix, field) if p)
    where = f'"{field}": ' if field else ""
    return EventError(i, field, f"{where}{msg[:1].lower()}{msg[1:]}",
                      evs[i] if evs is not None and i < len(evs) else None)


class _A(msgspec.Struct, gc=False):
    """Args shared by every event kind that links host and GPU work."""

    ext: Optional[I64] = msgspec.field(default=None, name="External id")
    ext_old: Optional[I64] = msgspec.field(default=None, name="external id")

    @property
    def ext_id(self) -> int:
        return self.ext if self.ext is not None else (self.ext_old if self.ext_old is not None else -1)


class CollArgs(_A, gc=False):
    """Collective args (record_param_comms on ops/annotations, and NCCL kernels)."""

    coll: Optional[str] = msgspec.field(default=None, name="Collective name")
    in_nelems: Optional[I64] = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Optional[I64] = msgspec.field(default=None, name="Out msg nelems")
    in_size_old: Optional[I64] = msgspec.field(default=None, name="In msg size")
    out_size_old: Optional[I64] = msgspec.field(default=None, name="Out msg size")
    group_size: Optional[I64] = msgspec.field(default=-1, name="Group size")
    dtype: Optional[str] = None
    pg_name: Optional[str] = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Optional[str] = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Raw = msgspec.field(default=Raw(), name="Process Group Ranks")
    coll_seq: Optional[I64] = msgspec.field(default=-1, name="Seq")


class OpArgs(CollArgs, gc=False):
    seq: Optional[I64] = msgspec.field(default=-1, name="Sequence number")
    fwd_tid: Optional[I64] = msgspec.field(default=-1, name="Fwd thread id")
    dims: Raw = msgspec.field(default=Raw(), name="Input Dims")
    dims_old: Raw = msgspec.field(default=Raw(), name="Input dims")
    types: Raw = msgspec.field(default=Raw(), name="Input type")
    flops: Optional[float] = MISSING


class PyArgs(msgspec.Struct, gc=False):
    py_id: Optional[I64] = msgspec.field(default=-1, name="Python id")
    py_parent: Optional[I64] = msgspec.field(default=-1, name="Python parent id")
    py_module: Optional[I64] = msgspec.field(default=-1, name="Python module id")


class _GpuArgs(CollArgs, gc=False):
    corr: Optional[I64] = msgspec.field(default=None, name="correlation")
    corr_old: Optional[I64] = msgspec.field(default=None, name="correlation id")
    device: Optional[I64] = None
    stream: Optional[I64] = None

    @property
    def corr_id(self) -> int:
        return self.corr if self.corr is not None else (self.corr_old if self.corr_old is not None else -1)


class RuntimeArgs(_GpuArgs, gc=False):
    cbid: Optional[I64] = -1


class KernelArgs(_GpuArgs, gc=False):
    queued: Optional[I64] = -1
    grid: Optional[list[I64]] = None
    block: Optional[list[I64]] = None
    regs: Optional[I32] = msgspec.field(default=-1, name="registers per thread")
    smem: Optional[I64] = msgspec.field(default=-1, name="shared memory")
    blocks_sm: Optional[F32] = msgspec.field(default=MISSING, name="blocks per SM")
    warps_sm: Optional[F32] = msgspec.field(default=MISSING, name="warps per SM")
    occupancy: Optional[F32] = msgspec.field(default=MISSING, name="est. achieved occupancy %")


class MemopArgs(_GpuArgs, gc=False):
    nbytes: Optional[I64] = msgspec.field(default=-1, name="bytes")


class SyncArgs(_GpuArgs, gc=False):
    wait_stream: Optional[I64] = msgspec.field(default=-1, name="wait_on_stream")
    wait_corr: Optional[I64] = msgspec.field(default=-1, name="wait_on_cuda_event_record_corr_id")


class MemoryArgs(msgspec.Struct, gc=False):
    mem_bytes: Optional[I64] = msgspec.field(default=0, name="Bytes")
    total_alloc: Optional[I64] = msgspec.field(default=-1, name="Total Allocated")
    total_reserved: Optional[I64] = msgspec.field(default=-1, name="Total Reserved")
    addr: Optional[I64] = msgspec.field(default=0, name="Addr")
    device_id: Optional[I64] = msgspec.field(default=-1, name="Device Id")
    device_type: Optional[I64] = msgspec.field(default=-1, name="Device Type")


class MetaArgs(msgspec.Struct, gc=False):
    label: Optional[Union[str, I64]] = msgspec.field(default=None, name="name")


NO_ARGS = Raw(b"{}")  # an event without args: joins into decode_args' array as an empty object


class Ev(msgspec.Struct, gc=False):
    """One trace event; ``args`` stays raw until its kind's handler decodes it (decode_args)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: Union[I64, str] = 0
    tid: Union[I64, str] = 0
    ts: float = MISSING
    dur: float = MISSING
    id: Union[I64, str, None] = None
    args: Raw = NO_ARGS


EVENTS = msgspec.json.Decoder(list[Ev])
ANY = msgspec.json.Decoder()
_ARGS_DECODERS: dict[type, msgspec.json.Decoder] = {}


def decode_args(evs: list[Ev], kind: type) -> list:
    """Decode the args of a group of events of one kind in a single call (C speed).

    Raises :class:`EventError` naming the first event whose args have a wrong type.
    """
    dec = _ARGS_DECODERS.get(kind)
    if dec is None:
        dec = _ARGS_DECODERS[kind] = msgspec.json.Decoder(list[kind])
    try:
        return dec.decode(b"[" + b",".join([e.args for e in evs]) + b"]")
    except msgspec.ValidationError as exc:
        raise validation_error(exc, "args", evs) from None
