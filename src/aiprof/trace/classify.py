"""Classify GPU activity by name and metadata. Documented in docs/metrics.md ("Classes").

Decisions are made once per distinct name (names repeat by the thousand), never per event.
"""
from __future__ import annotations

import re

COMPUTE = "compute"
COMMUNICATION = "communication"
MEMCPY = "memcpy"
MEMSET = "memset"

# NCCL kernels: the old scheme `ncclKernel_AllReduce_RING_LL_Sum_float` and the NCCL >= 2.19
# scheme `ncclDevKernel_AllReduce_Sum_f32_RING_LL`; also NVSHMEM and the custom all-reduce
# kernels that serving engines ship (vLLM `cross_device_reduce_*`).
_COMM_PREFIXES = ("nccl", "nvshmem", "cross_device_reduce", "void vllm::cross_device_reduce")
# FSDP's host annotations, one per module and phase: FSDP2's ("FSDP::all_gather (blocks.3)",
# "FSDP::post_backward_reduce (blocks.3)") and FSDP1's ("FullyShardedDataParallel.forward").
FSDP_ANNOTATIONS = ("FSDP::", "FullyShardedDataParallel.")
_NCCL_TYPE = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_COLLECTIVE_CANON = {
    "allreduce": "AllReduce",
    "all_reduce": "AllReduce",
    "allgather": "AllGather",
    "all_gather": "AllGather",
    "_allgather_base": "AllGather",
    "all_gather_into_tensor": "AllGather",
    "allgather_into_tensor_coalesced": "AllGather",
    "reducescatter": "ReduceScatter",
    "reduce_scatter": "ReduceScatter",
    "_reduce_scatter_base": "ReduceScatter",
    "reduce_scatter_tensor": "ReduceScatter",
    "reduce_scatter_tensor_coalesced": "ReduceScatter",
    "broadcast": "Broadcast",
    "reduce": "Reduce",
    "sendrecv": "SendRecv",
    "send": "SendRecv",
    "recv": "SendRecv",
    "alltoall": "AllToAll",
    "all_to_all": "AllToAll",
    "alltoall_base": "AllToAll",
    "all_to_allv": "AllToAll",
    "barrier": "Barrier",
    "gather": "Gather",
    "scatter": "Scatter",
}


def strip_kernel_name(name: str) -> str:
    """Drop a leading ``void `` so that prefixes can be matched."""
    return name[5:] if name.startswith("void ") else name


def kernel_class(name: str, has_collective_args: bool = False) -> str:
    """Return COMPUTE or COMMUNICATION for a GPU kernel name."""
    if has_collective_args:
        return COMMUNICATION
    n = strip_kernel_name(name).lower()
    if n.startswith(_COMM_PREFIXES) or "ncclkernel" in n or "nccldevkernel" in n:
        return COMMUNICATION
    return COMPUTE


def collective_type(name: str) -> str:
    """Canonical collective type (AllReduce, AllGather, ...) from a kernel or op name; "" if none."""
    m = _NCCL_TYPE.search(name)
    if m:
        key = m.group(1).lower()
        return _COLLECTIVE_CANON.get(key, m.group(1))
    n = name.lower()
    for prefix in ("nccl:", "c10d::", "gloo:", "record_param_comms"):
        if n.startswith(prefix):
            n = n[len(prefix):]
            break
    n = n.rstrip("_")
    return _COLLECTIVE_CANON.get(n, "")


def canonical_collective(name: str) -> str:
    """Canonical type for a ``Collective name`` arg such as ``allreduce`` or ``_allgather_base``."""
    key = name.lower().strip()
    return _COLLECTIVE_CANON.get(key, _COLLECTIVE_CANON.get(key.lstrip("_"), name))


_COPY = re.compile(r"Memcpy (\w+)(?: \((\w+) -> (\w+)\))?")


def copy_kind(name: str) -> tuple[str, str, str]:
    """Split ``Memcpy HtoD (Pageable -> Device)`` into ("HtoD", "Pageable", "Device")."""
    m = _COPY.match(name)
    if not m:
        return ("", "", "")
    return (m.group(1), m.group(2) or "", m.group(3) or "")


# Calls that block the calling host thread until GPU work (the device, a stream, an event) is
# done. cudaStreamWaitEvent (a wait on the GPU side) and cudaStreamQuery (a poll) return at once,
# so they are not here. Driver names are matched without their _v2/_v3 suffix.
BLOCKING_SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
})
# Copies that return only when done (synchronous with respect to the host).
BLOCKING_COPIES = frozenset({"cudaMemcpy", "cudaMemcpy2D", "cuMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD"})
LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel",
    "cuLaunchKernelEx", "cudaGraphLaunch", "cuGraphLaunch", "cudaLaunchKernelEx",
})


def is_sync_call(name: str) -> bool:
    """True for runtime/driver calls that block the host until the GPU catches up (the one
    definition used by the breakdown's sync time, the runtime analysis and the findings)."""
    base = name.split("_v", 1)[0] if name.startswith("cu") else name
    return base in BLOCKING_SYNC_CALLS or base in BLOCKING_COPIES
