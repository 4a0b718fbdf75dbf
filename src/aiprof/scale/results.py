"""Per-rank task results kept beside each rank's store, so that analysing an unchanged capture
again reads them instead of running its tasks (docs/scale.md, "Reused results").

A result is reused only when everything it was computed from is the same, as one key (SHA-256):
the phase, the task's arguments (those that name the analysis, not the run), the fingerprint of
every trace the task reads (size, mtime and sidecars, as the store's own check) and the code
(every source file of this aiprof, and numpy's, pyarrow's and Python's versions). An edit to any
of them is a miss.

The file is MessagePack read back into the task's result type by msgspec's typed decoder: reading
runs no code (unlike pickle, unsafe in a folder others may write) and anything unexpected (another
layout, a truncated file, a foreign key) reads as absent. numpy arrays and scalars travel as
MessagePack extensions and come back with their dtype, so a reused result is the one computed.
One file per rank and phase, replaced by a newer result, written atomically.
"""
from __future__ import annotations

import hashlib
import os
import platform
import tempfile
import typing
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path

import msgspec
import numpy as np

from aiprof.trace.store import fingerprint, store_dir_for

# Where a rank's results live, inside its store (removed with it when the trace changes).
RESULTS_DIR = "results"
# MessagePack extension codes: an array (dtype, shape, bytes), a numeric scalar (dtype, bytes),
# an array of Python objects (the strings of a column: a list, with its shape).
EXT_ARRAY, EXT_SCALAR, EXT_OBJECTS = 1, 2, 3


def _encode_other(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return msgspec.msgpack.Ext(EXT_OBJECTS, _PLAIN.encode([list(obj.shape), obj.ravel().tolist()]))
        return msgspec.msgpack.Ext(EXT_ARRAY, _PLAIN.encode([obj.dtype.str, list(obj.shape),
                                                             np.ascontiguousarray(obj).tobytes()]))
    if isinstance(obj, np.generic):
        return msgspec.msgpack.Ext(EXT_SCALAR, _PLAIN.encode([obj.dtype.str, obj.tobytes()]))
    raise NotImplementedError(f"cannot keep a {type(obj).__name__}")


def _decode_ext(code: int, data: memoryview) -> object:
    if code == EXT_ARRAY:
        dtype, shape, raw = _PLAIN_DEC.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()  # writable, as computed
    if code == EXT_SCALAR:
        dtype, raw = _PLAIN_DEC.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
    if code == EXT_OBJECTS:
        shape, items = _PLAIN_DEC.decode(data)
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    raise ValueError(f"unknown extension {code}")


def _decode_other(typ: type, obj: object) -> object:
    """A custom-typed field (np.ndarray) arrives already decoded by _decode_ext."""
    if isinstance(obj, typ if isinstance(typ, type) else object):
        return obj
    raise ValueError(f"expected {typ}, got {type(obj).__name__}")


_PLAIN = msgspec.msgpack.Encoder()
_PLAIN_DEC = msgspec.msgpack.Decoder()
# Also the keys' encoder: dicts in insertion order (msgspec sorts only str-keyed ones), which the
# same code on the same inputs repeats; a set's order may differ between processes (string
# hashing), so a set in the arguments can only cost a miss, never a wrong hit: callers pass sorted
# lists where they can.
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_other)


class _Entry(msgspec.Struct, array_like=True):
    key: str
    result: msgspec.Raw  # decoded into the task's type only when the key matches


_ENTRY = msgspec.msgpack.Decoder(_Entry)


@cache
def code_version() -> str:
    """This aiprof's source files and the versions that could change a result, as one digest."""
    import pyarrow

    import aiprof

    h = hashlib.sha256()
    root = Path(aiprof.__file__).parent
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    h.update(f"{np.__version__} {pyarrow.__version__} {platform.python_version()}".encode())
    return h.hexdigest()


def key(phase: str, args: object, sources: Sequence[str], seen: dict[str, dict] | None = None) -> str:
    """The key of a task's result: its phase, ``args`` (what names the result, not the run) and
    the fingerprints of the ``sources`` (trace files) it reads, under this code. ``seen``: the
    fingerprints already taken in this run, by path (a partner's trace is read by every rank's
    task: ten stats a fingerprint, once a run, not once a task)."""
    if seen is None:
        seen = {}
    fps = []
    for s in sources:
        fp = seen.get(s)
        if fp is None:
            fp = seen[s] = fingerprint(s)
        fps.append(fp)
    doc = [code_version(), phase, fps, args]
    return hashlib.sha256(_ENCODER.encode(doc)).hexdigest()


def path_for(source: str, phase: str) -> str:
    """Where the ``phase`` result of the rank whose trace is ``source`` is kept."""
    return os.path.join(store_dir_for(source), RESULTS_DIR, f"{phase}.msgpack")


@cache
def _decoder(result_type: object) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(result_type, dec_hook=_decode_other, ext_hook=_decode_ext)


def load(path: str, want: str, result_type: object) -> object | None:
    """The result kept at ``path`` under key ``want``, as ``result_type``; None when there is
    none, its key differs, or it does not read as that type."""
    try:
        with open(path, "rb") as f:
            entry = _ENTRY.decode(f.read())
        if entry.key != want:
            return None
        return _decoder(result_type).decode(entry.result)
    except (OSError, msgspec.DecodeError, ValueError, TypeError):
        return None


def save(path: str, k: str, result: object) -> None:
    """Keep ``result`` at ``path`` under key ``k`` (atomically). A folder that cannot be written
    (a read-only store) keeps nothing: the result is still returned to the analysis."""
    try:
        blob = _PLAIN.encode([k, msgspec.Raw(_ENCODER.encode(result))])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, NotImplementedError, TypeError):
        pass


def remembered(fn: Callable, path: str | None, k: str, args: tuple) -> object:
    """Run one task and keep its result at ``path`` (the task the engine runs for a missing
    result; None: one without a key, kept nowhere)."""
    out = fn(*args)
    if path:
        save(path, k, out)
    return out


def result_type(fn: Callable) -> object:
    """What ``fn`` returns, from its annotation: the type its kept results are read back as."""
    return typing.get_type_hints(fn)["return"]


class Call(typing.NamedTuple):
    """One task of a phase: its arguments, what names its result, and the traces it reads (the
    first is the rank's own: its result is kept in that rank's store)."""

    args: tuple
    key_args: object
    sources: Sequence[str]


def run_phase(engine, phase: str, fn: Callable, calls: Sequence[Call], reuse: bool, keep: bool,
              progress: Callable[[str, int, int], None] | None = None, nodes: Sequence[str] | None = None,
              placed: dict[int, str] | None = None,
              seen: dict[str, dict] | None = None) -> Iterator[tuple[int, object]]:
    """Yield (index, result) for every call: the kept result where it is current (``reuse``),
    else the engine's, which is kept (``keep``). The engine sees only the calls without one.
    ``nodes``: where each call should run (engine.map); ``placed`` is filled with the node each
    computed result came from (by call index); ``seen``: the run's fingerprints (:func:`key`)."""
    if not (reuse or keep):
        yield from engine.map(phase, fn, [c.args for c in calls], progress, nodes)
        if placed is not None:
            placed.update(getattr(engine, "nodes", {}))
        return
    typ = result_type(fn)
    todo: list[int] = []
    todo_calls: list[tuple] = []
    hits: list[tuple[int, object]] = []
    for i, c in enumerate(calls):  # every key before any result is handed out (the caller may edit them)
        try:
            k = key(phase, c.key_args, c.sources, seen)
        except OSError:  # a trace gone meanwhile: the task itself says so, in the usual one line
            todo.append(i)
            todo_calls.append((fn, None, "", c.args))
            continue
        path = path_for(c.sources[0], phase)
        hit = load(path, k, typ) if reuse else None
        if hit is None:
            todo.append(i)
            todo_calls.append((fn, path, k, c.args))
        else:
            hits.append((i, hit))
    done = len(hits)
    for n, (i, hit) in enumerate(hits, 1):
        if progress:
            progress(phase, n, len(calls))
        yield i, hit
    engine.stats.reused(phase, done)
    if not todo_calls:
        return
    where = [nodes[i] for i in todo] if nodes else None
    shifted = (lambda p, n, _t: progress(p, done + n, len(calls))) if progress else None
    for j, out in engine.map(phase, remembered, todo_calls, shifted, where):
        yield todo[j], out
    if placed is not None:
        placed.update({todo[j]: n for j, n in getattr(engine, "nodes", {}).items()})
