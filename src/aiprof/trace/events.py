"""The part of a Kineto trace event that aiprof decodes, as msgspec structs.

An event's ``args`` stay raw (``msgspec.Raw``) in the first pass; each event kind's handler then
decodes the args of all its events in one call with a small struct of just the fields it reads
(``decode_args``). Unknown fields are skipped in C. Old and new arg names are both listed
(``External id``/``external id``, ``correlation``/``correlation id``, ...).
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec
from msgspec import Raw


class _A(msgspec.Struct, gc=False):
    """Args shared by every event kind that links host and GPU work."""

    ext: Optional[int] = msgspec.field(default=None, name="External id")
    ext_old: Optional[int] = msgspec.field(default=None, name="external id")

    @property
    def ext_id(self) -> int:
        return self.ext if self.ext is not None else (self.ext_old if self.ext_old is not None else -1)


class CollArgs(_A, gc=False):
    """Collective args (record_param_comms on ops/annotations, and NCCL kernels)."""

    coll: Optional[str] = msgspec.field(default=None, name="Collective name")
    in_nelems: Optional[int] = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Optional[int] = msgspec.field(default=None, name="Out msg nelems")
    in_size_old: Optional[int] = msgspec.field(default=None, name="In msg size")
    out_size_old: Optional[int] = msgspec.field(default=None, name="Out msg size")
    group_size: Optional[int] = msgspec.field(default=None, name="Group size")
    dtype: Optional[str] = None
    pg_name: Optional[str] = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Optional[str] = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Raw = msgspec.field(default=Raw(), name="Process Group Ranks")
    coll_seq: Optional[int] = msgspec.field(default=None, name="Seq")


class OpArgs(CollArgs, gc=False):
    seq: Optional[int] = msgspec.field(default=None, name="Sequence number")
    fwd_tid: Optional[int] = msgspec.field(default=None, name="Fwd thread id")
    dims: Raw = msgspec.field(default=Raw(), name="Input Dims")
    dims_old: Raw = msgspec.field(default=Raw(), name="Input dims")
    types: Raw = msgspec.field(default=Raw(), name="Input type")
    flops: Optional[float] = None


class PyArgs(msgspec.Struct, gc=False):
    py_id: Optional[int] = msgspec.field(default=None, name="Python id")
    py_parent: Optional[int] = msgspec.field(default=None, name="Python parent id")
    py_module: Optional[int] = msgspec.field(default=None, name="Python module id")


class _GpuArgs(CollArgs, gc=False):
    corr: Optional[int] = msgspec.field(default=None, name="correlation")
    corr_old: Optional[int] = msgspec.field(default=None, name="correlation id")
    device: Optional[int] = None
    stream: Optional[int] = None

    @property
    def corr_id(self) -> int:
        return self.corr if self.corr is not None else (self.corr_old if self.corr_old is not None else -1)


class RuntimeArgs(_GpuArgs, gc=False):
    cbid: Optional[int] = None


class KernelArgs(_GpuArgs, gc=False):
    queued: Optional[int] = None
    grid: Optional[list[int]] = None
    block: Optional[list[int]] = None
    regs: Optional[int] = msgspec.field(default=None, name="registers per thread")
    smem: Optional[int] = msgspec.field(default=None, name="shared memory")
    blocks_sm: Optional[float] = msgspec.field(default=None, name="blocks per SM")
    warps_sm: Optional[float] = msgspec.field(default=None, name="warps per SM")
    occupancy: Optional[float] = msgspec.field(default=None, name="est. achieved occupancy %")


class MemopArgs(_GpuArgs, gc=False):
    nbytes: Optional[int] = msgspec.field(default=None, name="bytes")


class SyncArgs(_GpuArgs, gc=False):
    wait_stream: Optional[int] = msgspec.field(default=None, name="wait_on_stream")
    wait_corr: Optional[int] = msgspec.field(default=None, name="wait_on_cuda_event_record_corr_id")


class MemoryArgs(msgspec.Struct, gc=False):
    mem_bytes: Optional[int] = msgspec.field(default=None, name="Bytes")
    total_alloc: Optional[int] = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Optional[int] = msgspec.field(default=None, name="Total Reserved")
    addr: Optional[int] = msgspec.field(default=None, name="Addr")
    device_id: Optional[int] = msgspec.field(default=None, name="Device Id")
    device_type: Optional[int] = msgspec.field(default=None, name="Device Type")


class MetaArgs(msgspec.Struct, gc=False):
    label: Optional[Union[str, int]] = msgspec.field(default=None, name="name")


class Ev(msgspec.Struct, gc=False):
    """One trace event; ``args`` stays raw until its kind's handler decodes it (see _args)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: float = 0.0
    dur: float = 0.0
    id: Union[int, str, None] = None
    args: Raw = Raw()


EVENTS = msgspec.json.Decoder(list[Ev])
ANY = msgspec.json.Decoder()
_ARGS_DECODERS: dict[type, msgspec.json.Decoder] = {}


def decode_args(evs: list[Ev], kind: type) -> list:
    """Decode the args of a group of events of one kind in a single call (C speed)."""
    dec = _ARGS_DECODERS.get(kind)
    if dec is None:
        dec = _ARGS_DECODERS[kind] = msgspec.json.Decoder(list[kind])
    return dec.decode(b"[" + b",".join([e.args if len(e.args) else b"{}" for e in evs]) + b"]")
