"""Reader for Kineto / torch.profiler Chrome-trace JSON (``.json`` or ``.json.gz``).

The file is streamed: the ``traceEvents`` array is read in chunks of a few MB, cut at event
boundaries into batches of a few hundred KB, and each batch is decoded by msgspec straight
into small typed structs (unknown fields are skipped in C), then turned into columns. Peak
memory is bounded by one chunk plus the columns, not by the JSON size.

Why batches: a batch's events become Python objects of about twice its JSON size (more with
their decoded args), and the builder walks them once per column. Small enough to stay in a
core's cache, the walks run from cache; a whole 8 MB chunk's objects do not fit, and ingest ran
~1.6x slower (DECODE_BYTES). The tables do not depend on the batches (builder.Builder).

Cutting: a boundary candidate is a ``},`` in the byte stream. A candidate inside a nested
object or a string leaves unbalanced brackets or an open string, so the chunk fails to decode
and the next candidate to the left is tried. Nothing is ever silently mis-split.
"""
from __future__ import annotations

import gzip
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import msgspec
from isal import isal_zlib  # ISA-L's inflate: zlib's stream API at about twice its speed (docs/scale.md)

from aiprof.errors import TraceError
from aiprof.trace import limits
from aiprof.trace.builder import TABLES, Builder
from aiprof.trace.events import ANY, EVENTS, EventError, validation_error
from aiprof.trace.limits import Limits
from aiprof.trace.table import Table
from aiprof.trace.workers import usable_cpus

__all__ = ["CHUNK_BYTES", "DECODE_BYTES", "TABLES", "ParsedTrace", "decode_block", "read_header", "read_trace"]

# JSON read (and inflated) per step of the serial reader. The text is decoded right after, in
# DECODE_BYTES batches: 1 MiB of it is still in the core's cache when msgspec reads it; 8 MiB was
# not (a 29 MB ddp2 rank read and stored: 0.220 CPU-s with 8 MiB, 0.201 with 1 MiB, 0.206 with
# 512 KiB, medians of 7 rounds on the 2-core machine), and a host full of ingest tasks shares its
# memory bandwidth (docs/scale.md, "Why a task costs more CPU when the host is full").
CHUNK_BYTES = 1 << 20
# The parallel reader's blocks, one per worker process's task: larger, so that its fixed cost
# per block (a pipe write, a merge) stays small against the block's decoding.
PARALLEL_BLOCK_BYTES = 8 << 20
# A text that holds no complete event once this much of it is buffered is not a trace this
# reader accepts (an event this large, or broken JSON): at most this much is held for one event.
MAX_EVENT_BYTES = 64 << 20
# JSON decoded and built per batch. Its Python objects (~2x the JSON, more with the args) should
# stay in a core's L2 cache (1 MB on the EPYC that measured it) while the builder walks them
# column by column: on the 105 MB benchmark trace, 8 MB batches took 1.6x the CPU time of
# 256 KB ones; 64 KB ones 1.1x (numpy's fixed cost per call starts to count).
DECODE_BYTES = 256 << 10
_MAX_CUT_TRIES = 12
_HEADER_LIMIT = 64 << 20


@dataclass
class ParsedTrace:
    """What one trace file yields: its tables and its top-level metadata."""

    tables: dict[str, Table]
    meta: dict
    n_events: int
    workers: int = 1  # processes that decoded it (1: this one)


class _Reader:
    """Sequential reader over a plain or gzip file that reports progress in file bytes.

    Inflates at most what was asked for (``max_length``), so a gzip bomb costs one chunk of
    memory at a time, and stops at the bounds of :mod:`aiprof.trace.limits`.
    """

    def __init__(self, path: str, progress: Optional[Callable[[int, int], None]],
                 lim: Optional[Limits] = None) -> None:
        self.path = path
        self.lim = lim if lim is not None else limits.current()
        self.f = open(path, "rb")
        self.total = os.fstat(self.f.fileno()).st_size
        magic = self.f.read(2)
        self.f.seek(0)
        self.gz = magic == b"\x1f\x8b"
        self.inflate = isal_zlib.decompressobj(wbits=31) if self.gz else None
        self.pending = b""  # compressed bytes read from the file, not yet inflated
        self.inflated = 0
        self.progress = progress
        self.eof = False

    def read(self, n: int) -> bytes:
        if self.eof:
            return b""
        if not self.gz:
            data = self.f.read(n)
            if not data:
                self.eof = True
            self.inflated += len(data)
            if self.inflated > self.lim.max_bytes:
                raise self.lim.too_big(self.path, inflated=False)
            self._tick()
            return data
        out = []
        size = 0
        while size < n:
            if not self.pending:
                self.pending = self.f.read(1 << 20)
                if not self.pending:
                    if not self.inflate.eof:
                        raise TraceError(self.path, "truncated gzip stream (the compressed file ends early)")
                    self.eof = True
                    break
            try:
                piece = self.inflate.decompress(self.pending, n - size)
                self.pending = self.inflate.unconsumed_tail
                if self.inflate.eof and self.inflate.unused_data:  # concatenated gzip members
                    self.pending = self.inflate.unused_data
                    self.inflate = isal_zlib.decompressobj(wbits=31)
            except isal_zlib.error as exc:
                raise TraceError(self.path, f"corrupt gzip data ({exc})") from None
            out.append(piece)
            size += len(piece)
            self._check(len(piece))
        self._tick()
        return b"".join(out)

    def _check(self, more: int) -> None:
        self.inflated += more
        if self.inflated > self.lim.max_bytes:
            raise self.lim.too_big(self.path, inflated=True)
        if self.inflated > limits.GZIP_RATIO_AFTER_BYTES:
            ratio = self.inflated / max(1, self.f.tell() - len(self.pending))
            if ratio > self.lim.max_ratio:
                raise self.lim.bomb(self.path, ratio)

    def rewind(self) -> None:
        """Start reading the file again from its first byte."""
        self.f.seek(0)
        self.inflate = isal_zlib.decompressobj(wbits=31) if self.gz else None
        self.pending = b""
        self.inflated = 0
        self.eof = False

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress(self.f.tell(), self.total)

    def close(self) -> None:
        self.f.close()


def _skip_ws(buf: bytes, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in b" \t\r\n":
        i += 1
    return i


def _json_error(path: str, data: bytes) -> TraceError:
    """Explain why ``data`` is not a trace: invalid JSON, or JSON of another shape."""
    try:
        ANY.decode(data)
    except msgspec.DecodeError as exc:
        return TraceError(path, f"not valid JSON ({exc})")
    return TraceError(path, "valid JSON but not a Kineto/Chrome trace (no \"traceEvents\" array)")


def read_trace(path: str, progress: Optional[Callable[[int, int], None]] = None,
               chunk_bytes: int = CHUNK_BYTES, workers: Optional[int] = None) -> ParsedTrace:
    """Parse one Kineto trace file into tables. Raises :class:`TraceError` on bad input.

    ``workers`` > 1 decodes large Kineto-formatted files in that many worker processes
    (default: $AIPROF_INGEST_WORKERS, else the number of usable CPUs, at most 4); small files are
    always read in this process. The workers are started by aiprof (:mod:`aiprof.trace.workers`)
    and never run the caller's ``__main__``; when they cannot run, the file is read here.
    """
    if workers is None:
        workers = default_workers()
    try:
        reader = _Reader(path, progress)
    except FileNotFoundError:
        raise TraceError(path, "no such file (it may have been removed)") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, expected a trace file") from None
    except PermissionError:
        raise TraceError(path, "permission denied") from None
    try:
        if not reader.gz and reader.total > reader.lim.max_bytes:  # refused before reading a byte
            raise reader.lim.too_big(path, inflated=False)
        st0 = os.fstat(reader.f.fileno())
        parsed = _parse(reader, chunk_bytes, workers)
        st1 = os.stat(path) if os.path.exists(path) else None
        if st1 is None:
            raise TraceError(path, "file disappeared while it was being read")
        if (st1.st_size, st1.st_mtime_ns) != (st0.st_size, st0.st_mtime_ns):
            raise TraceError(path, "file changed while it was being read")
        return parsed
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(path, f"read failed ({exc})") from None
    except RecursionError:  # only msgspec's decoding recurses here: the input nests too deep
        raise TraceError(path, "JSON nested too deeply to be a trace (more than "
                               f"{sys.getrecursionlimit()} levels)") from None
    finally:
        reader.close()


_MAX_DEFAULT_WORKERS = 4  # beyond 4, the one reading thread (inflate, cut) is the bottleneck


def read_header(path: str, step: int = 64 << 10) -> dict | None:
    """The top-level keys Kineto writes before ``"traceEvents"`` (``distributedInfo``,
    ``deviceProperties``, ...), read without the events: {} for a bare event array, None when
    the head cannot be read as such (ingest names the problem when it reads the whole file)."""
    try:
        r = _Reader(path, None)
    except OSError:
        return None
    try:
        buf = r.read(step)
        start = _skip_ws(buf, 3 if buf.startswith(b"\xef\xbb\xbf") else 0)
        if buf[start:start + 1] == b"[":
            return {}
        key = buf.find(b'"traceEvents"')
        while key < 0 and not r.eof and len(buf) < _HEADER_LIMIT:
            buf += r.read(step)
            key = buf.find(b'"traceEvents"')
        if key < 0:
            return None
        meta = ANY.decode(buf[:key] + b'"traceEvents": []}')
    except (TraceError, OSError, msgspec.DecodeError):
        return None
    finally:
        r.close()
    return meta if isinstance(meta, dict) else None


def default_workers() -> int:
    """Ingest worker processes: $AIPROF_INGEST_WORKERS, else usable CPUs (at most 4)."""
    env = (os.environ.get("AIPROF_INGEST_WORKERS") or "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            print(f"aiprof: warning: AIPROF_INGEST_WORKERS={env!r} is not a number; using 1", file=sys.stderr)
            return 1
    return min(_MAX_DEFAULT_WORKERS, usable_cpus())


def _parse(r: _Reader, chunk_bytes: int, workers: int = 1) -> ParsedTrace:
    path = r.path
    buf = r.read(chunk_bytes)
    if not buf.strip():
        raise TraceError(path, "empty file")
    start = _skip_ws(buf, 3 if buf.startswith(b"\xef\xbb\xbf") else 0)
    header = b""
    if buf[start:start + 1] == b"[":  # bare array of events (Chrome JSON array format)
        pos = start + 1
    elif buf[start:start + 1] == b"{":
        key = buf.find(b'"traceEvents"')
        while key < 0 and not r.eof and len(buf) < _HEADER_LIMIT:
            buf += r.read(chunk_bytes)
            key = buf.find(b'"traceEvents"')
        if key < 0:
            while not r.eof and len(buf) < _HEADER_LIMIT:
                buf += r.read(chunk_bytes)
            raise _json_error(path, buf)
        i = _skip_ws(buf, key + len(b'"traceEvents"'))
        while i >= len(buf) - 1 and not r.eof:  # the key ends this chunk: read on to its value
            buf += r.read(chunk_bytes)
            i = _skip_ws(buf, i)
        if buf[i:i + 1] != b":":
            raise _json_error(path, buf)
        i = _skip_ws(buf, i + 1)
        while i >= len(buf) and not r.eof:
            buf += r.read(chunk_bytes)
            i = _skip_ws(buf, i)
        if buf[i:i + 1] != b"[":
            raise TraceError(path, "\"traceEvents\" is not an array")
        header = buf[:key]
        pos = i + 1
    else:
        raise _json_error(path, buf[:4096] if len(buf) > 4096 else buf)

    b = Builder()
    buf = buf[pos:]
    at = _At(path, pos, r.lim)
    if workers > 1 and r.total >= PARALLEL_MIN_BYTES and buf.startswith(_KINETO_FIRST):
        done = _parse_parallel(r, b, buf, max(chunk_bytes, PARALLEL_BLOCK_BYTES), workers)
        if done is not None:
            buf, used, consumed = done
            at.offset += consumed
            tail = _decode_last(b, buf, at, bare=not header)
            meta = _decode_meta(path, header, tail)
            return _finish(path, b, meta, used)
        # a block did not decode, or the workers could not run: read the file here, from its start
        r.rewind()
        return _parse(r, chunk_bytes, workers=1)
    while True:
        if not r.eof and len(buf) < chunk_bytes:
            buf += r.read(chunk_bytes)
            continue
        consumed = _decode_bulk(b, buf, at)
        if consumed is None:  # no cut decoded: take more input, or give up
            if r.eof:
                break
            if len(buf) > max(8 * chunk_bytes, MAX_EVENT_BYTES):
                raise _syntax_error(buf, at)
            buf += r.read(chunk_bytes)
            continue
        buf = buf[consumed:]
        at.offset += consumed
        if r.eof:
            break
    # What is left holds the last event(s), the closing bracket and the document's tail.
    tail = _decode_last(b, buf, at, bare=not header)
    meta = _decode_meta(path, header, tail)
    return _finish(path, b, meta)


@dataclass
class _At:
    """Where the buffer being decoded starts: to name a bad byte by its offset in the file's JSON."""

    path: str
    offset: int
    lim: Limits

    def count(self, b: Builder) -> None:
        """Stop once the trace holds more events than the limit (checked as batches are added)."""
        if b.n_events > self.lim.max_events:
            raise self.lim.too_many(self.path)

    def error(self, problem: str) -> TraceError:
        return TraceError(self.path, problem)

    def event_error(self, err: EventError) -> TraceError:
        return TraceError(self.path, err.describe())


def _finish(path: str, b: Builder, meta: dict, workers: int = 1) -> ParsedTrace:
    tables = b.finish()
    if b.agent_threads:
        meta["aiprof_agent_threads_dropped"] = b.agent_threads
    if b.negative_durations:
        meta["aiprof_negative_durations"] = b.negative_durations
    if b.n_events == 0 or not tables:
        raise TraceError(path, "no profiler events in \"traceEvents\" (is this a torch.profiler trace?)")
    return ParsedTrace(tables=tables, meta=meta, n_events=b.n_events, workers=workers)


# Kineto writes one event per block: "  {" at indent 2, its fields deeper, and "\n  },\n  {"
# between events. JSON strings cannot hold a raw newline, so that separator is never inside a
# string; with Kineto's indentation it is never inside a nested object either. That makes the
# cut safe without decoding, so blocks can be decoded in other processes. Should a block fail to
# decode anyway (a file that only looks Kineto-formatted, or a bad event), the whole file is
# re-read in this process, which names the problem precisely.
_KINETO_FIRST = b"\n  {\n"
_KINETO_SEP = b"\n  },\n  {"
PARALLEL_MIN_BYTES = 48 << 20  # below, starting the workers costs more than it saves


def decode_block(data: bytes | bytearray) -> Builder | None:
    """Worker side: decode ``[`` events ``]`` into a fresh builder (None if anything is wrong)."""
    if not isinstance(data, bytearray):  # the batches are cut in place (a worker gets a bytearray)
        data = bytearray(data)
    try:
        b = Builder()
        for batch in _kineto_batches(data):
            b.add(EVENTS.decode(batch))
        b.end_chunk()
    except (msgspec.DecodeError, EventError):  # DecodeError includes ValidationError
        return None
    return b


def _kineto_batches(data: bytearray):
    """``[`` events ``]`` (Kineto's layout) as batches of about DECODE_BYTES, each ``[...]``.

    Cut in place at the separators, without copying: the "," after a batch's last event becomes
    its "]" while it is decoded, then the next batch's "[".
    """
    view = memoryview(data)
    start = 0  # data[start] is the batch's "["
    while len(data) - start > 2 * DECODE_BYTES:
        cut = data.find(_KINETO_SEP, start + DECODE_BYTES)
        if cut < 0:
            break
        comma = cut + 4  # _KINETO_SEP is "\n  }" "," "\n  {"
        data[comma] = ord("]")
        yield view[start:comma + 1]
        data[comma] = ord("[")
        start = comma
    yield view[start:]


def _parse_parallel(r: _Reader, b: Builder, buf: bytes, chunk_bytes: int,
                    workers: int) -> tuple[bytes, int, int] | None:
    """Decode Kineto-formatted blocks in ``workers`` processes; return the unconsumed tail, the
    workers used and the bytes consumed.

    None when a block did not decode or a worker could not run: the caller re-reads the file.
    """
    from collections import deque

    from aiprof.trace.workers import WorkerLost, WorkerPool

    pending: deque = deque()
    consumed = 0
    try:
        with WorkerPool(workers) as pool:
            while True:
                while not r.eof and len(buf) < chunk_bytes:
                    buf += r.read(chunk_bytes)
                cut = buf.rfind(_KINETO_SEP)
                if cut < 0:
                    break  # only the last event and the document's tail are left
                pending.append(pool.submit(memoryview(buf)[: cut + 4]))
                buf = buf[cut + 5:]
                consumed += cut + 5
                while len(pending) > 2 * workers:  # bound memory: at most a few blocks in flight
                    part = pending.popleft().result()
                    if part is None:  # leave on an exception: the pool kills the busy workers
                        raise WorkerLost("a block did not decode")
                    b.merge(part)
                    if b.n_events > r.lim.max_events:
                        raise r.lim.too_many(r.path)
            while pending:
                part = pending.popleft().result()
                if part is None:
                    raise WorkerLost("a block did not decode")
                b.merge(part)
                if b.n_events > r.lim.max_events:
                    raise r.lim.too_many(r.path)
    except WorkerLost:
        return None
    return buf, workers, consumed


def _event_at(b: Builder, at: _At, exc: msgspec.ValidationError) -> TraceError:
    """A decoded chunk's type error, named by the event's index in the whole trace."""
    err = validation_error(exc)
    err.index += b.n_events
    return at.event_error(err)


def _add(b: Builder, evs: list, at: _At) -> None:
    try:
        b.add(evs)
    except EventError as err:
        raise at.event_error(err) from None
    at.count(b)


def _decode_bulk(b: Builder, buf: bytes, at: _At) -> Optional[int]:
    """Decode events up to the last good ``},`` cut, in batches; return bytes consumed, or None.

    Batches of about DECODE_BYTES while more than two are left; then the rest up to the
    buffer's last good cut (which is also what happens when a batch's window has no good cut:
    an event larger than the window, or a syntax error that the caller then reports).
    """
    done = 0
    while len(buf) - done > 2 * DECODE_BYTES:
        used = _decode_cut(b, buf, done, done + DECODE_BYTES, at)
        if used is None:
            break
        done = used
    used = _decode_cut(b, buf, done, len(buf), at)
    b.end_chunk()
    return used if used is not None else (done or None)


def _decode_cut(b: Builder, buf: bytes, start: int, end: int, at: _At) -> Optional[int]:
    """Decode the events of ``buf[start:]`` before the last good ``},`` cut left of ``end``;
    return the offset after the cut, or None when no cut decodes.

    A cut inside a string or a nested object leaves invalid JSON (DecodeError: try the next cut
    to the left). A type error (ValidationError) is raised while decoding values that all lie
    before the cut, so it is the file's own: it is reported at once.
    """
    for _ in range(_MAX_CUT_TRIES):
        cut = buf.rfind(b"},", start, end)
        if cut < 0:
            return None
        try:
            evs = EVENTS.decode(b"".join((b"[", memoryview(buf)[start: cut + 1], b"]")))  # one copy
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError)
            raise _event_at(b, at, exc) from None
        except msgspec.DecodeError:
            end = cut
            continue
        _add(b, evs, at)
        return cut + 2
    return None


def _decode_last(b: Builder, buf: bytes, at: _At, bare: bool = False) -> bytes:
    """Decode the final events before ``]``; return the bytes after the array.

    ``bare``: the file is a Chrome JSON *array* trace, whose closing ``]`` may be missing (the
    Trace Event Format allows it, for traces written by programs that may die mid-way).
    """
    end = len(buf)
    tries = 0
    while True:
        close = buf.rfind(b"]", 0, end)
        if close < 0:
            break
        try:
            evs = EVENTS.decode(b"[" + buf[:close + 1])
        except msgspec.ValidationError as exc:
            raise _event_at(b, at, exc) from None
        except msgspec.DecodeError:
            end = close
            tries += 1
            if tries > 64 and len(buf) > (1 << 20):
                break
            continue
        _add(b, evs, at)
        return buf[close + 1:]
    if bare:
        body = buf.rstrip()
        body = body[:-1] if body.endswith(b",") else body
        try:
            evs = EVENTS.decode(b"[" + body + b"]")
        except msgspec.ValidationError as exc:
            raise _event_at(b, at, exc) from None
        except msgspec.DecodeError:
            pass
        else:
            _add(b, evs, at)
            return b""
    raise _syntax_error(buf, at, truncated=b.n_events > 0)


_BYTE = re.compile(r"\(byte (\d+)\)")


def _syntax_error(buf: bytes, at: _At, truncated: bool = False) -> TraceError:
    """Why the events in ``buf`` do not decode, with the bad byte's offset in the file's JSON."""
    try:
        ANY.decode(b"[" + buf)
    except msgspec.DecodeError as exc:
        msg = str(exc)
        m = _BYTE.search(msg)
        if m is not None:
            n = int(m.group(1)) - 1 + at.offset  # the "[" we put in front is not the file's
            if n >= at.offset + len(buf) - 1 and truncated:
                return at.error("truncated: the JSON ends inside \"traceEvents\"")
            msg = _BYTE.sub(f"(at byte {n:,} of the JSON)", msg)
        elif truncated and "truncated" in msg:
            return at.error("truncated: the JSON ends inside \"traceEvents\"")
        return at.error(f"not valid JSON inside \"traceEvents\" ({msg})")
    return at.error("truncated: the JSON ends inside \"traceEvents\"")


def _decode_meta(path: str, header: bytes, tail: bytes) -> dict:
    if not header:  # bare-array trace: only whitespace may follow
        if tail.strip():
            raise TraceError(path, "not valid JSON (data after the event array)")
        return {}
    doc = header + b'"traceEvents": []' + tail
    try:
        meta = ANY.decode(doc)
    except msgspec.DecodeError as exc:
        if not tail.strip():
            raise TraceError(path, "truncated: the JSON ends after \"traceEvents\"") from None
        # the offset msgspec gives is in this re-assembled document, not in the file: drop it
        raise TraceError(path, f"not valid JSON around \"traceEvents\" ({_BYTE.sub('', str(exc)).strip()})") from None
    if not isinstance(meta, dict):
        raise TraceError(path, "not a Kineto trace (top level is not an object)")
    meta.pop("traceEvents", None)
    return meta
