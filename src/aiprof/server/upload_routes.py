"""Resumable, checksummed uploads of capture files (docs/server.md, "Uploads").

``GET .../files/{name}`` says how many bytes the server holds durably; ``PUT
...?offset=O&size=S&sha256=H`` appends from O to ``rank<R>/.uploads/<name>.part``. Every
:data:`DURABLE_EVERY` bytes (and when the connection ends) the part is fsync'd and its length
recorded in ``<name>.durable`` (itself fsync'd): only those bytes count after a crash or a
restart, so a resumed upload never builds on a tail the disk may not hold. When S bytes are in,
the part is hashed and renamed into place only if the SHA-256 matches. Uploads to one file are
serialised; a rank that is not part of the capture is refused (400) before any byte is stored.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
from collections import deque
from typing import Any, Container

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import BODY_IDLE_TIMEOUT_S, BodyTimeout, HTTPError, body_chunks, within
from aiprof.server.store import MAX_RANK, capture_ranks, read_json, safe_name, safe_rank

__all__ = ["UploadRoutes", "capture_ranks", "check_rank"]

MAX_FILES_PER_RANK = 16
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# fsync the part this often: a crash re-sends at most this much, and 200 MB cost ~25 fsyncs
DURABLE_EVERY = 8 << 20
# A body's bytes are written on a worker thread once this many have arrived (and at its end):
# a file of at most this size (the client's block) takes one call.
WRITE_BATCH = 1 << 20
# Bytes received and not written yet, over all uploads: past it an upload writes what it holds
# at once and reads no more of its body until there is room (its client waits: TCP flow
# control), so the memory held stays bounded with thousands of uploads at a time (1,024 ranks'
# 256 kB files, read whole before their writes, held 195 MiB without this wait). An upload that
# finds no room for ROOM_WAIT_S (the disk stalled) keeps what arrived and is answered 503.
WRITE_BUDGET = 64 << 20
ROOM_WAIT_S = 30.0
READ_MAX = 256 << 10  # the most one piece of a body can be (asyncio reads a socket 256 KiB at a time)
# Longest wait for another upload of the same file to finish. Longer than BODY_IDLE_TIMEOUT_S,
# so a stalled holder is cut off (its bytes kept) before a resuming client gives up.
LOCK_WAIT_S = 2 * BODY_IDLE_TIMEOUT_S


def check_rank(cid: str, ranks: Container[int] | None, rank: int) -> None:
    """HTTPError 400 when ``rank`` is not among ``ranks``, the ranks of capture ``cid``
    (DataDir.capture_rank_set; None: not known yet, anything accepted)."""
    if ranks is None or rank in ranks:
        return
    ranks = ranks if isinstance(ranks, range) else sorted(ranks)
    shown = f"0-{len(ranks) - 1}" if isinstance(ranks, range) and len(ranks) > 1 else ", ".join(map(str, ranks))
    raise HTTPError(400, f"rank {rank} is not part of capture {cid} (its ranks: {shown or 'none'})")


def _query_int(q: Any, key: str, lo: int, hi: int) -> int | None:
    raw = q.get(key)
    if raw is None or raw == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise HTTPError(400, f"{key} must be an integer") from None
    if not lo <= v <= hi:
        raise HTTPError(400, f"{key} must be in {lo}..{hi}")
    return v


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(path: str, obj: Any) -> None:
    """A small JSON record written atomically under a fixed temporary name (the caller holds the
    file's upload lock: no other writer of it), without tempfile's random names."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, separators=(",", ":")))
    os.replace(tmp, path)


def make_durable(f: Any, marker: str, received: int, size: int, sha: str) -> None:
    """fsync the open part ``f``, then record ``received`` as its durable length (fsync'd rename)."""
    f.flush()
    os.fsync(f.fileno())
    tmp = marker + ".tmp"
    with open(tmp, "w") as m:
        json.dump({"bytes": received, "size": size, "sha256": sha}, m)
        m.flush()
        os.fsync(m.fileno())
    os.replace(tmp, marker)
    _fsync_dir(os.path.dirname(marker))


class UploadRoutes:
    """``GET|PUT /captures/{cid}/ranks/{r}/files/{name}``."""

    def __init__(self, ctx: ServiceContext, queue: AnalysisQueue) -> None:
        self.ctx = ctx
        self.data = ctx.data
        self.queue = queue
        self.file_locks: dict[tuple, asyncio.Lock] = {}
        self.buffered = 0  # body bytes received and not written yet, over all uploads (WRITE_BUDGET)
        # uploads waiting for room (WRITE_BUDGET), first come first served, and those let in that
        # have not taken their next piece yet (each counted as a full read, READ_MAX)
        self.waiters: deque[asyncio.Future] = deque()
        self.admitting = 0

    def _paths(self, cid: str, rank: int, name: str) -> tuple[str, str]:
        """The file's final path and its part's, each checked to lie in DATA (once per request)."""
        return self.data.file_path(cid, rank, name), self.data.part_path(cid, rank, name)

    @staticmethod
    def _durable(part: str) -> dict[str, Any]:
        """The part's durable record: bytes fsync'd, and the size and sha256 they belong to."""
        rec = read_json(part[:-len(".part")] + ".durable")
        return rec if isinstance(rec, dict) and isinstance(rec.get("bytes"), int) else {"bytes": 0}

    def _file_status(self, cid: str, rank: int, name: str) -> dict:
        return self._status(*self._paths(cid, rank, name))[0]

    def _status(self, final: str, part: str) -> tuple[dict, dict | None]:
        """The file's status, and the part's durable record when it is not complete."""
        if os.path.isfile(final):
            sha = read_json(part[:-len(".part")] + ".sha256.json") or {}
            return {"complete": True, "received": os.path.getsize(final), "sha256": sha.get("sha256")}, None
        try:
            held = os.path.getsize(part)
        except OSError:
            return {"complete": False, "received": 0}, {"bytes": 0}
        durable = self._durable(part)
        return {"complete": False, "received": min(held, durable["bytes"])}, durable

    async def file_status(self, req: Request) -> Response:
        p = req.path_params
        cid, rank, name = safe_name(p["cid"], "capture id"), safe_rank(p["rank"]), safe_name(p["name"], "file name")
        check_rank(cid, self.data.capture_rank_set(cid)[1], rank)
        return JSONResponse(await self.ctx.io(self._file_status, cid, rank, name))

    async def put_file(self, req: Request) -> Response:
        p, q = req.path_params, req.query_params
        cid = safe_name(p["cid"], "capture id")
        rank = safe_rank(p["rank"])
        name = safe_name(p["name"], "file name")
        try:
            offset, size = int(q.get("offset", "0")), int(q["size"])
        except (KeyError, ValueError):
            raise HTTPError(400, "offset and size must be integers") from None
        sha = q.get("sha256", "").lower()
        if not SHA_RE.match(sha):
            raise HTTPError(400, "sha256 must be 64 hex digits")
        if size < 0 or size > self.ctx.max_file:
            raise HTTPError(413, f"file of {size} bytes is over the limit of {self.ctx.max_file} bytes")
        world = _query_int(q, "world_size", 1, MAX_RANK)
        if world is not None and rank >= world:
            raise HTTPError(400, f"rank {rank} is not part of a job of world size {world}")
        key = (cid, rank, name)
        lock = self.file_locks.setdefault(key, asyncio.Lock())
        try:
            try:  # the holder is cut off after BODY_IDLE_TIMEOUT_S without data: this wait ends first
                await within(lock.acquire(), LOCK_WAIT_S)
            except asyncio.TimeoutError:
                raise HTTPError(409, f"another upload of {name} of rank {rank} is in progress; retry later",
                                busy=True) from None
            try:
                return await self._receive(req, cid, rank, name, offset, size, sha, world)
            finally:
                lock.release()
        finally:
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self.file_locks.pop(key, None)

    async def _receive(self, req: Request, cid: str, rank: int, name: str, offset: int, size: int, sha: str,
                       world: int | None) -> Response:
        state, ranks = self.data.capture_rank_set(cid)
        check_rank(cid, ranks, rank)
        q = req.query_params
        # Every file operation runs on a worker thread, in as few calls as the body allows: the
        # body is gathered up to WRITE_BATCH, then one call opens the part (checking the file's
        # status, creating the capture) and writes and hashes the batch; the last call also
        # fsyncs, and for a complete file puts it in place. A small file is one call. On the
        # event loop, 2,048 small files of a 1,024-rank capture held every other request back
        # (docs/server.md, "Measured"), and a write to a slow disk blocks once its dirty pages
        # pile up.
        p = _Part(self, cid, rank, name, offset, size, sha, q.get("job"), world, q.get("scope"))
        received = offset
        over = stalled = busy = False
        synced = offset
        buf = bytearray()

        async def flush(durable: bool) -> None:
            nonlocal buf, synced
            data, buf = buf, bytearray()
            try:
                await self.ctx.io(p.write, data, received if durable else None)
            finally:
                self._written(len(data))
            if durable:
                synced = received

        chunks = body_chunks(req)
        try:
            while True:
                # past the budget, no more of the body is taken in until writes make room; an
                # upload writes what it holds before it waits (else uploads holding the budget
                # and waiting for it would wait for each other)
                if received < size and not self._has_room():
                    if buf:
                        await flush(False)
                    if not await self._room():
                        busy = True  # the disk is far behind: keep what arrived, the client resumes later
                        break
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                if received + len(chunk) > size:
                    over = True
                    break
                view = memoryview(chunk)
                while view:  # sync points at multiples of DURABLE_EVERY, wherever chunks end
                    piece = view[:DURABLE_EVERY - received % DURABLE_EVERY]
                    buf += piece
                    self.buffered += len(piece)
                    self.ctx.stats["upload_bytes_received"] = self.ctx.stats.get("upload_bytes_received", 0) + len(piece)
                    self.ctx.stats["upload_buffered_peak"] = max(self.ctx.stats.get("upload_buffered_peak", 0),
                                                                 self.buffered)
                    received += len(piece)
                    view = view[len(piece):]
                    if received % DURABLE_EVERY == 0:
                        await flush(True)
                    elif received < size and (len(buf) >= WRITE_BATCH or self.buffered > WRITE_BUDGET):
                        await flush(False)
                    if p.already is not None:  # complete already with this checksum: the rest is not needed
                        return JSONResponse(p.already)
        except ClientDisconnect:  # keep what arrived: the client resumes from it
            pass
        except BodyTimeout:  # a stalled client: keep what arrived, free the file for a resumed upload
            stalled = True
        finally:
            await chunks.aclose()  # its idle timer ends here
            # shielded: also when cancelled (what arrived is kept)
            try:
                with anyio.CancelScope(shield=True):
                    done = await self.ctx.io(
                        p.finish, buf, received if not over and received > synced else None,
                        not over and not stalled and received == size, over)
            finally:
                self._written(len(buf))
                if p.created:
                    self.queue.active.add(cid)
        if p.already is not None:
            return JSONResponse(p.already)
        if over:
            raise HTTPError(413, f"more bytes than the declared size {size}")
        if busy:
            raise HTTPError(503, f"the server is behind writing uploads to disk; {received} bytes kept, resume "
                                 "from there later", received=received, busy=True)
        if stalled:
            raise HTTPError(408, f"no data for {BODY_IDLE_TIMEOUT_S:g} s; {received} bytes kept, resume from there",
                            received=received)
        if received < size:
            return JSONResponse({"complete": False, "received": received})
        assert done is not None
        digest, n = done
        if digest != sha or n != size:
            self.ctx.stats["checksum_mismatch"] += 1
            raise HTTPError(422, f"checksum mismatch for {name}: got {digest}, expected {sha}; send it again")
        self.ctx.stats["uploads"] += 1
        self.ctx.stats["upload_bytes"] += n
        if name == "meta.json":
            if ranks is None:  # else nothing to learn: no state rewrite
                self._learn_ranks(cid, rank)
            self.queue.rank_complete(cid, rank)
        return JSONResponse({"complete": True, "received": n, "sha256": digest})

    def _written(self, n: int) -> None:
        """``n`` buffered bytes are written (or dropped): room for the uploads waiting."""
        self.buffered -= n
        self._admit()

    def _admit(self) -> None:
        """Let the uploads waiting in, in order, as far as the room goes (one wake-up each, not
        every waiter on every write); those that gave up are dropped from the line."""
        while self.waiters:
            fut = self.waiters[0]
            if fut.done():
                self.waiters.popleft()
                continue
            if self.buffered + (self.admitting + 1) * READ_MAX > WRITE_BUDGET:
                return
            self.waiters.popleft()
            fut.set_result(None)
            self.admitting += 1

    def _has_room(self) -> bool:
        """Room for another piece within WRITE_BUDGET, and no upload waiting for it before."""
        self._admit()
        return not self.waiters and self.buffered + (self.admitting + 1) * READ_MAX <= WRITE_BUDGET

    async def _room(self) -> bool:
        """Wait until there is room for another piece within WRITE_BUDGET, behind the uploads
        already waiting (False: none within ROOM_WAIT_S)."""
        if self._has_room():
            return True
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self._admit()  # room may have come since (no write need end for it): let in at once
        try:
            await within(fut, ROOM_WAIT_S)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if fut.done() and not fut.cancelled():
                self.admitting -= 1  # let in: what it takes from here on counts in self.buffered
            else:
                fut.cancel()  # given up (timed out, or the request cancelled): skipped when its turn comes
            self._admit()  # its place in line (or its share of the room) is free for the next

    def _open_part(self, cid: str, rank: int, name: str, offset: int, size: int, sha: str, job: str | None,
                   world: int | None, scope: str | None) -> dict | tuple[Any, bool, str, str]:
        """On a worker thread, before the body: the file's status (a dict when it is complete with
        this checksum: nothing to receive); else the capture (created when the server did not
        trigger it: True), the part, open for appending at ``offset``, and the final and part
        paths. HTTPError when the upload cannot go on."""
        final, part = self._paths(cid, rank, name)
        st, durable = self._status(final, part)
        if st["complete"]:
            if st.get("sha256") == sha:
                return st
            raise HTTPError(409, f"{name} of rank {rank} is already complete with another checksum")
        assert durable is not None
        marker = part[:-len(".part")] + ".durable"
        if st["received"] and (durable.get("sha256"), durable.get("size")) != (sha, size):
            self._drop_part(part, marker)  # the partial copy is of another file: start it over
            raise HTTPError(409, f"the {st['received']} bytes held of {name} belong to another file; "
                                 "they were dropped", received=0)
        if offset != st["received"]:
            raise HTTPError(409, f"offset {offset} does not match the {st['received']} bytes held", received=st["received"])
        created = self._ensure_capture(cid, job, rank, world, scope)
        rdir = os.path.dirname(final)
        try:
            existing = [f for f in os.listdir(rdir) if not f.startswith(".")]
        except FileNotFoundError:
            existing = []
        if name not in existing and len(existing) >= MAX_FILES_PER_RANK:
            raise HTTPError(413, f"rank {rank} already has {len(existing)} files")
        os.makedirs(os.path.dirname(part), exist_ok=True)
        f = open(part, "ab")
        try:
            f.truncate(offset)  # bytes past the durable length may not be on disk: never build on them
        except BaseException:
            f.close()
            raise
        return f, created, final, part

    def _learn_ranks(self, cid: str, rank: int) -> None:
        """A capture whose ranks are not known yet (an older uploader) takes them from its first meta.json."""
        meta = read_json(self.data.file_path(cid, rank, "meta.json"))
        if not isinstance(meta, dict):
            return

        def upd(s: dict) -> None:
            if capture_ranks(s) is not None:
                return
            if (meta.get("trigger") or {}).get("scope") == "rank":
                s["solo_rank"] = rank
            elif isinstance(meta.get("world_size"), int) and meta["world_size"] > rank:
                s["world_size"] = meta["world_size"]
        self.data.update_capture(cid, upd)

    @staticmethod
    def _drop_part(part: str, marker: str) -> None:
        for p in (marker, part):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def _ensure_capture(self, cid: str, job: str | None, rank: int, world: int | None, scope: str | None) -> bool:
        """An upload for a capture the server did not trigger (``aiprof run --server --iterations``,
        the auto-trigger): created with the ranks its first upload names (True: created now; the
        caller, on the event loop, adds it to the analysis queue's active captures)."""
        with self.data.lock:
            if self.data.capture_view(cid) is None:
                os.makedirs(self.data.capture_dir(cid), exist_ok=True)
                self.data.save_capture(cid, {"capture_id": cid, "job": safe_name(job, "job") if job else None,
                                             "created": time.time(), "expected": None, "results": {},
                                             "world_size": world, "solo_rank": rank if scope == "rank" else None,
                                             "deadline": time.time() + 600, "auto_analyze": True,
                                             "state": "capturing", "source": "agent"})
                return True
        return False


class _Part:
    """One upload's part file, used from worker threads only (one call at a time): opened with
    the first bytes to write, hashed as they are written, put in place when complete."""

    def __init__(self, routes: UploadRoutes, cid: str, rank: int, name: str, offset: int, size: int, sha: str,
                 job: str | None, world: int | None, scope: str | None) -> None:
        self.routes = routes
        self.args = (cid, rank, name, offset, size, sha, job, world, scope)
        self.size, self.sha = size, sha
        self.f: Any = None
        self.final = self.part = self.marker = ""
        self.hasher: Any = None
        self.length = offset  # the part's length: what it held plus what was written since
        self.created = False  # the capture was created by this upload (the server did not trigger it)
        self.already: dict | None = None  # the file is complete already, with this checksum
        self.failed = False  # opening it was refused (HTTPError): nothing more to do

    def _open(self) -> bool:
        """Open the part once (False: complete already or refused; nothing to write)."""
        if self.f is not None:
            return True
        if self.already is not None or self.failed:
            return False
        try:
            opened = self.routes._open_part(*self.args)
        except BaseException:
            self.failed = True
            raise
        if isinstance(opened, dict):
            self.already = opened
            return False
        self.f, self.created, self.final, self.part = opened
        self.marker = self.part[:-len(".part")] + ".durable"
        self.hasher = hashlib.sha256()
        offset = self.args[3]
        if offset:  # a resumed upload: the bytes held count in the checksum (read back once)
            with open(self.part, "rb") as f:
                left = offset
                while left:
                    b = f.read(min(left, 1 << 20))
                    if not b:
                        break
                    self.hasher.update(b)
                    left -= len(b)
        return True

    def write(self, data: bytes, durable: int | None = None) -> None:
        """Append ``data`` (hashed as it is written); ``durable``: then make that many bytes durable."""
        if not self._open():
            return
        self.f.write(data)
        self.hasher.update(data)
        self.length += len(data)
        if durable is not None:
            make_durable(self.f, self.marker, durable, self.size, self.sha)

    def finish(self, tail: bytes, sync: int | None, complete: bool, over: bool) -> tuple[str, int] | None:
        """After the body: write ``tail``; fsync and record ``sync`` bytes as durable (None: nothing
        new to record); when ``complete``, put the file in place if its SHA-256 matches (else drop
        the part); ``over`` (more bytes than declared): drop the part. The digest and size when
        complete."""
        if over:
            if self.f is not None:
                self.f.close()
                UploadRoutes._drop_part(self.part, self.marker)
            return None
        if not self._open():  # also for a body that brought nothing: the file's status is checked
            return None
        try:
            self.f.write(tail)
            self.hasher.update(tail)
            self.length += len(tail)
            if complete:  # its data on disk before the rename makes it visible; no durable record needed:
                self.f.flush()  # after a crash either the file is in place, whole, or the part is resent
                os.fsync(self.f.fileno())
            elif sync is not None:
                make_durable(self.f, self.marker, sync, self.size, self.sha)
        finally:
            self.f.close()
        if not complete:
            return None
        digest, n = self.hasher.hexdigest(), self.length
        if digest != self.sha or n != self.size:
            UploadRoutes._drop_part(self.part, self.marker)
            return digest, n
        write_record(self.part[:-len(".part")] + ".sha256.json", {"sha256": digest, "size": n})
        os.replace(self.part, self.final)
        try:
            os.unlink(self.marker)  # of an earlier attempt that was cut off
        except FileNotFoundError:
            pass
        return digest, n
