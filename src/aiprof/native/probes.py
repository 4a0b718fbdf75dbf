"""Probe files: which library symbols to trace and which of their arguments to record.

A probe file is JSON (docs/capture.md, "Probe files")::

    {"libraries": [{"name": "nccl", "library": "libnccl.so*",
                    "symbols": [{"symbol": "ncclAllReduce",
                                 "args": [{"index": 2, "name": "count", "type": "u64"}, ...]}]}]}

``library`` is a glob on the loaded module's file name; ``index`` the argument's position (0 =
first). :func:`load_probe_file` validates a file into a :class:`ProbeSpec`, a plain dict that
travels in the capture request; :func:`decode_args` turns a call's raw 64-bit argument words
into the named, typed values the probe asked for.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from aiprof.errors import UsageError

DEFAULT_PROBE_FILE = os.path.join(os.path.dirname(__file__), "probes", "default.json")
MAX_ARGS = 8  # the engine records the first 8 argument words of a call (agent.js MAXARGS)
MAX_SYMBOLS = 4096  # a symbol id is 16 bits in the engine; far above any sane probe file
# Symbols called so often (per launch, per allocation) that an ~0.5 µs hook on each would slow
# the job measurably: refused unless the probe entry says "allow_hot": true (docs/capture.md).
HOT_SYMBOLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGetDevice",
    "cudaSetDevice", "cudaGetLastError", "cudaPeekAtLastError", "cudaStreamIsCapturing",
    "cudaEventRecord", "cudaMemcpyAsync", "cuMemcpyAsync", "cudaEventQuery", "cuEventQuery",
    "cuStreamGetCaptureInfo", "cudaStreamGetCaptureInfo", "cuCtxGetCurrent", "cuCtxSetCurrent",
    "cuGetProcAddress", "cuGetProcAddress_v2", "pthread_mutex_lock", "pthread_mutex_unlock",
    "malloc", "free", "memcpy", "memset",
})

ARG_TYPES = ("u64", "i64", "u32", "i32", "ptr", "out_ptr", "f64", "nccl_datatype", "nccl_redop",
             "cuda_memcpy_kind", "fd")

# ncclDataType_t (nccl.h): value -> (name, bytes per element)
NCCL_DATATYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8),
                  5: ("uint64", 8), 6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8),
                  9: ("bfloat16", 2), 10: ("float8e4m3", 1), 11: ("float8e5m2", 1)}
NCCL_REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
CUDA_MEMCPY_KINDS = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class ProbeError(UsageError):
    """A probe file that cannot be used (its path and the first problem in it)."""


@dataclass
class ProbeSpec:
    """A validated probe file. ``symbols`` is flat: one entry per (library, symbol) with its id."""

    source: str
    libraries: list[dict[str, Any]]

    @property
    def symbols(self) -> list[dict[str, Any]]:
        """Every symbol entry, each with ``lib`` (the library's name) added."""
        return [dict(s, lib=lib["name"]) for lib in self.libraries for s in lib["symbols"]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what the capture request carries)."""
        return {"source": self.source, "libraries": self.libraries}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeSpec":
        """Rebuild from :meth:`to_dict` (re-validated: the request crossed a process boundary)."""
        return parse_probes(d, d.get("source", "<request>"))

    def engine_config(self) -> list[dict[str, Any]]:
        """The engine's view: per library a glob and per symbol its id, argument count and
        out-pointer mask (agent.js)."""
        out = []
        for lib in self.libraries:
            syms = []
            for s in lib["symbols"]:
                idx = [a["index"] for a in s["args"]]
                mask = 0
                for a in s["args"]:
                    if a["type"] == "out_ptr":
                        mask |= 1 << a["index"]
                syms.append({"id": s["id"], "name": s["symbol"], "nargs": (max(idx) + 1) if idx else 0,
                             "deref_mask": mask})
            out.append({"name": lib["name"], "pattern": lib["library"], "symbols": syms})
        return out


def _fail(src: str, where: str, why: str) -> "ProbeError":
    return ProbeError(f"probe file {src}: {where}: {why}")


def parse_probes(raw: Any, src: str) -> ProbeSpec:
    """Validate a probe file's parsed JSON; raises ProbeError (one line) on the first problem."""
    if not isinstance(raw, dict) or not isinstance(raw.get("libraries"), list) or not raw["libraries"]:
        raise _fail(src, "top level", 'expected {"libraries": [...]} with at least one library')
    libs: list[dict[str, Any]] = []
    names: set[str] = set()
    next_id = 0
    for li, lib in enumerate(raw["libraries"]):
        where = f"libraries[{li}]"
        if not isinstance(lib, dict):
            raise _fail(src, where, "expected an object")
        name, pattern, syms = lib.get("name"), lib.get("library"), lib.get("symbols")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _fail(src, where, f"'name' must be a short identifier, got {name!r}")
        if name in names:
            raise _fail(src, where, f"library name {name!r} used twice")
        names.add(name)
        if not isinstance(pattern, str) or not pattern or "/" in pattern:
            raise _fail(src, where, f"'library' must be a file-name glob such as 'libnccl.so*', got {pattern!r}")
        if not isinstance(syms, list) or not syms:
            raise _fail(src, where, "'symbols' must be a non-empty list")
        out_syms: list[dict[str, Any]] = []
        seen: set[str] = set()
        for si, s in enumerate(syms):
            w = f"{where}.symbols[{si}]"
            if not isinstance(s, dict):
                raise _fail(src, w, "expected an object")
            sym = s.get("symbol")
            if not isinstance(sym, str) or not _NAME.match(sym.replace("@", "_").replace(".", "_")):
                raise _fail(src, w, f"'symbol' must be a symbol name, got {sym!r}")
            if sym in seen:
                raise _fail(src, w, f"symbol {sym!r} listed twice")
            seen.add(sym)
            allow_hot = s.get("allow_hot", False)
            if not isinstance(allow_hot, bool):
                raise _fail(src, w, "'allow_hot' must be true or false")
            if sym in HOT_SYMBOLS and not allow_hot:
                raise _fail(src, w, f"{sym} is called too often to hook without slowing the job "
                                    "(add \"allow_hot\": true to trace it anyway)")
            args = s.get("args", [])
            if not isinstance(args, list):
                raise _fail(src, w, "'args' must be a list")
            out_args = []
            used: set[int] = set()
            for ai, a in enumerate(args):
                wa = f"{w}.args[{ai}]"
                if not isinstance(a, dict):
                    raise _fail(src, wa, "expected an object")
                idx, an, at = a.get("index"), a.get("name"), a.get("type", "u64")
                if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < MAX_ARGS:
                    raise _fail(src, wa, f"'index' must be an integer 0..{MAX_ARGS - 1}, got {idx!r}")
                if idx in used:
                    raise _fail(src, wa, f"argument {idx} listed twice")
                used.add(idx)
                if not isinstance(an, str) or not _NAME.match(an):
                    raise _fail(src, wa, f"'name' must be an identifier, got {an!r}")
                if at not in ARG_TYPES:
                    raise _fail(src, wa, f"unknown type {at!r}; choose from {', '.join(ARG_TYPES)}")
                out_args.append({"index": idx, "name": an, "type": at})
            out_syms.append({"symbol": sym, "id": next_id, "args": out_args, "allow_hot": allow_hot})
            next_id += 1
            if next_id > MAX_SYMBOLS:
                raise _fail(src, w, f"more than {MAX_SYMBOLS} symbols")
        libs.append({"name": name, "library": pattern, "symbols": out_syms})
    return ProbeSpec(source=src, libraries=libs)


def load_probe_file(path: str | None) -> ProbeSpec:
    """Read and validate a probe file (``None`` or ``"default"``: the default one shipped with aiprof)."""
    if path is None or path == "default":
        path = DEFAULT_PROBE_FILE
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ProbeError(f"probe file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProbeError(f"probe file {path}: cannot read it ({exc})") from None
    except ValueError as exc:
        raise ProbeError(f"probe file {path}: not valid JSON ({exc})") from None
    return parse_probes(raw, os.path.abspath(path))


def _signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def decode_arg(raw: int, typ: str) -> Any:
    """One argument word as the probe file's type asks (enums as names, pointers as hex)."""
    if typ in ("u64",):
        return int(raw)
    if typ == "i64":
        return _signed(raw, 64)
    if typ == "u32":
        return int(raw) & 0xFFFFFFFF
    if typ in ("i32", "fd"):
        return _signed(raw, 32)
    if typ in ("ptr", "out_ptr"):
        return hex(raw)
    if typ == "f64":
        import struct

        return struct.unpack("<d", struct.pack("<Q", raw & (2**64 - 1)))[0]
    if typ == "nccl_datatype":
        return NCCL_DATATYPES.get(int(raw) & 0xFFFFFFFF, (f"dtype{raw & 0xFFFFFFFF}", 0))[0]
    if typ == "nccl_redop":
        return NCCL_REDOPS.get(int(raw) & 0xFFFFFFFF, f"op{raw & 0xFFFFFFFF}")
    if typ == "cuda_memcpy_kind":
        return CUDA_MEMCPY_KINDS.get(int(raw) & 0xFFFFFFFF, f"kind{raw & 0xFFFFFFFF}")
    return int(raw)


def decode_args(sym: dict[str, Any], words: list[int]) -> dict[str, Any]:
    """The named arguments of one call, plus ``bytes`` for NCCL calls (count × datatype size)."""
    out: dict[str, Any] = {}
    for a in sym["args"]:
        out[a["name"]] = decode_arg(int(words[a["index"]]), a["type"])
    count = out.get("count")
    dt_arg = next((a for a in sym["args"] if a["type"] == "nccl_datatype"), None)
    if isinstance(count, int) and dt_arg is not None:
        size = NCCL_DATATYPES.get(int(words[dt_arg["index"]]) & 0xFFFFFFFF, ("", 0))[1]
        if size:
            out["bytes"] = count * size
    return out
