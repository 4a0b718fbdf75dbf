"""The job's communication settings, recorded in every capture's meta.json (``communication``).

A slow collective is explained by a setting far more often than by the hardware: NCCL told not
to use NVLink peer-to-peer (``NCCL_P2P_DISABLE``), a transport forced (``NCCL_NET``,
``NCCL_SOCKET_IFNAME``), a protocol or algorithm pinned, torch's own knobs
(``TORCH_NCCL_*``). The diagnosis names the setting that slows a collective only if the capture
says what the job ran with (issue 29, item 3). Read at capture time, bounded, never raising into
the job; values are kept as given (these variables hold no secrets; anything else is not read).
"""
from __future__ import annotations

import os
import sys
from typing import Any

# Environment variables that configure the job's communication: NCCL's and torch's distributed
# knobs, gloo's interface, and CUDA's connection count (it changes how NCCL kernels overlap).
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_GLOO_", "GLOO_", "NVSHMEM_",
                "TORCH_SYMM_MEM_", "UCX_", "FI_")
ENV_NAMES = frozenset({"CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_VISIBLE_DEVICES", "TORCH_CPP_LOG_LEVEL"})
# Bounds: a job's environment is the user's; the capture keeps at most this much of it.
MAX_VARS = 128
MAX_VALUE_CHARS = 256


def _rank(name: str) -> tuple[int, str]:
    """Sort key: NCCL's and torch's NCCL variables (the ones the diagnosis reads), then the single
    names (CUDA's), then the other prefixes in ENV_PREFIXES order; alphabetical within each."""
    if name.startswith(ENV_PREFIXES[:2]):
        return 0, name
    if name in ENV_NAMES:
        return 1, name
    return 2 + next(i for i, p in enumerate(ENV_PREFIXES) if name.startswith(p)), name


def _env() -> dict[str, str]:
    names = sorted((k for k in os.environ if k.startswith(ENV_PREFIXES) or k in ENV_NAMES), key=_rank)
    # past the bound, libfabric's or UCX's many variables are the ones cut, never NCCL's
    return {k: os.environ[k][:MAX_VALUE_CHARS] for k in sorted(names[:MAX_VARS])}


def _process_group() -> dict[str, Any] | None:
    """The default process group's backend and size, through torch's public API (None before
    init_process_group, or without torch.distributed)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        out: dict[str, Any] = {"backend": str(dist.get_backend()), "world_size": int(dist.get_world_size())}
        try:
            out["backend_config"] = str(dist.get_backend_config())[:MAX_VALUE_CHARS]
        except Exception:  # older torch: no backend config
            pass
        return out
    except Exception:
        return None


def _nccl_version() -> str | None:
    torch = sys.modules.get("torch")
    try:
        v = torch.cuda.nccl.version() if torch is not None and torch.cuda.is_available() else None
    except Exception:
        return None
    if isinstance(v, tuple):
        return ".".join(str(x) for x in v)
    return str(v) if v is not None else None


def comm_settings() -> dict[str, Any]:
    """``{"env": {...}, "process_group": {...} | None, "nccl_version": "2.28.3" | None}``."""
    out: dict[str, Any] = {"env": {}, "process_group": None, "nccl_version": None}
    try:
        out["env"] = _env()
    except Exception:
        pass
    out["process_group"] = _process_group()
    out["nccl_version"] = _nccl_version()
    return out
