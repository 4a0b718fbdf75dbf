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
import json
import os
import re
import time
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.client import file_sha256
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import BODY_IDLE_TIMEOUT_S, BodyTimeout, HTTPError, body_chunks
from aiprof.server.store import MAX_RANK, read_json, safe_name, safe_rank, write_json

MAX_FILES_PER_RANK = 16
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# fsync the part this often: a crash re-sends at most this much, and 200 MB cost ~25 fsyncs
DURABLE_EVERY = 8 << 20
# Longest wait for another upload of the same file to finish. Longer than BODY_IDLE_TIMEOUT_S,
# so a stalled holder is cut off (its bytes kept) before a resuming client gives up.
LOCK_WAIT_S = 2 * BODY_IDLE_TIMEOUT_S


def capture_ranks(st: dict[str, Any]) -> list[int] | range | None:
    """The ranks a capture may receive files for, from its state; None when not known yet.

    A capture the server triggered expects the ranks its job had then; one an agent took by
    itself names its world size (or, taken by one rank alone, that rank) with its first upload.
    """
    if st.get("expected") is not None:
        return [int(r) for r in st["expected"]]
    if st.get("solo_rank") is not None:
        return [int(st["solo_rank"])]
    if st.get("world_size") is not None:
        return range(int(st["world_size"]))
    return None


def check_rank(cid: str, st: dict[str, Any] | None, rank: int) -> None:
    """HTTPError 400 when ``rank`` is not part of capture ``cid`` (nothing known: accepted)."""
    ranks = capture_ranks(st or {})
    if ranks is None or rank in ranks:
        return
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

    def _durable(self, cid: str, rank: int, name: str) -> dict[str, Any]:
        """The part's durable record: bytes fsync'd, and the size and sha256 they belong to."""
        rec = read_json(self.data.part_path(cid, rank, name)[:-len(".part")] + ".durable")
        return rec if isinstance(rec, dict) and isinstance(rec.get("bytes"), int) else {"bytes": 0}

    def _file_status(self, cid: str, rank: int, name: str) -> dict:
        final = self.data.file_path(cid, rank, name)
        if os.path.isfile(final):
            sha = read_json(self.data.part_path(cid, rank, name)[:-len(".part")] + ".sha256.json") or {}
            return {"complete": True, "received": os.path.getsize(final), "sha256": sha.get("sha256")}
        part = self.data.part_path(cid, rank, name)
        held = os.path.getsize(part) if os.path.isfile(part) else 0
        return {"complete": False, "received": min(held, self._durable(cid, rank, name)["bytes"])}

    async def file_status(self, req: Request) -> Response:
        p = req.path_params
        cid, rank, name = safe_name(p["cid"], "capture id"), safe_rank(p["rank"]), safe_name(p["name"], "file name")
        check_rank(cid, self.data.capture_view(cid), rank)
        return JSONResponse(await anyio.to_thread.run_sync(self._file_status, cid, rank, name))

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
                await asyncio.wait_for(lock.acquire(), LOCK_WAIT_S)
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
        state = self.data.capture_view(cid)
        check_rank(cid, state, rank)
        q = req.query_params
        # the file work before the body (stat, read the records, create the capture, open the part)
        # and after it (fsync, hash, rename) runs on a worker thread: on the event loop, 2,048 small
        # files of a 1,024-rank capture held every other request back (docs/server.md, "Measured")
        opened = await anyio.to_thread.run_sync(self._open_part, cid, rank, name, offset, size, sha, q.get("job"),
                                                world, q.get("scope"))
        if isinstance(opened, dict):  # complete already, with this checksum
            return JSONResponse(opened)
        f, created = opened
        if created:
            self.queue.active.add(cid)
        part = self.data.part_path(cid, rank, name)
        marker = part[:-len(".part")] + ".durable"
        received = offset
        over = stalled = False
        synced = offset
        try:
            async for chunk in body_chunks(req):
                if received + len(chunk) > size:
                    over = True
                    break
                view = memoryview(chunk)
                while view:  # sync points at multiples of DURABLE_EVERY, wherever chunks end
                    piece = view[:DURABLE_EVERY - received % DURABLE_EVERY]
                    f.write(piece)
                    received += len(piece)
                    view = view[len(piece):]
                    if received % DURABLE_EVERY == 0:
                        await anyio.to_thread.run_sync(make_durable, f, marker, received, size, sha)
                        synced = received
        except ClientDisconnect:  # keep what arrived: the client resumes from it
            pass
        except BodyTimeout:  # a stalled client: keep what arrived, free the file for a resumed upload
            stalled = True
        finally:
            # off the event loop (three fsyncs: ~10-40 ms that would stall every other request), shielded:
            # also when cancelled; a complete file is hashed and put in place in the same call
            with anyio.CancelScope(shield=True):
                done = await anyio.to_thread.run_sync(self._close_part, f, cid, rank, name, marker,
                                                      received if not over and received > synced else None,
                                                      size, sha, not over and not stalled and received == size)
        if over:
            self._drop_part(part, marker)
            raise HTTPError(413, f"more bytes than the declared size {size}")
        if stalled:
            raise HTTPError(408, f"no data for {BODY_IDLE_TIMEOUT_S:g} s; {received} bytes kept, resume from there",
                            received=received)
        if received < size:
            return JSONResponse({"complete": False, "received": received})
        digest, n = done
        if digest != sha or n != size:
            self.ctx.stats["checksum_mismatch"] += 1
            raise HTTPError(422, f"checksum mismatch for {name}: got {digest}, expected {sha}; send it again")
        self.ctx.stats["uploads"] += 1
        self.ctx.stats["upload_bytes"] += n
        if name == "meta.json":
            if state is None or capture_ranks(state) is None:  # else nothing to learn: no state rewrite
                self._learn_ranks(cid, rank)
            self.queue.rank_complete(cid, rank)
        return JSONResponse({"complete": True, "received": n, "sha256": digest})

    def _open_part(self, cid: str, rank: int, name: str, offset: int, size: int, sha: str, job: str | None,
                   world: int | None, scope: str | None) -> dict | tuple[Any, bool]:
        """On a worker thread, before the body: the file's status (a dict when it is complete with
        this checksum: nothing to receive); else the capture (created when the server did not
        trigger it: True) and the part, open for appending at ``offset``. HTTPError when the
        upload cannot go on."""
        st = self._file_status(cid, rank, name)
        if st["complete"]:
            if st.get("sha256") == sha:
                return st
            raise HTTPError(409, f"{name} of rank {rank} is already complete with another checksum")
        part = self.data.part_path(cid, rank, name)
        marker = part[:-len(".part")] + ".durable"
        durable = self._durable(cid, rank, name)
        if st["received"] and (durable.get("sha256"), durable.get("size")) != (sha, size):
            self._drop_part(part, marker)  # the partial copy is of another file: start it over
            raise HTTPError(409, f"the {st['received']} bytes held of {name} belong to another file; "
                                 "they were dropped", received=0)
        if offset != st["received"]:
            raise HTTPError(409, f"offset {offset} does not match the {st['received']} bytes held", received=st["received"])
        created = self._ensure_capture(cid, job, rank, world, scope)
        rdir = self.data.rank_dir(cid, rank)
        if not os.path.isdir(rdir) or name not in os.listdir(rdir):
            existing = [f for f in (os.listdir(rdir) if os.path.isdir(rdir) else []) if not f.startswith(".")]
            if len(existing) >= MAX_FILES_PER_RANK:
                raise HTTPError(413, f"rank {rank} already has {len(existing)} files")
        os.makedirs(os.path.dirname(part), exist_ok=True)
        f = open(part, "ab")
        try:
            f.truncate(offset)  # bytes past the durable length may not be on disk: never build on them
        except BaseException:
            f.close()
            raise
        return f, created

    def _close_part(self, f: Any, cid: str, rank: int, name: str, marker: str, sync: int | None, size: int,
                    sha: str, complete: bool) -> tuple[str, int] | None:
        """On a worker thread, after the body: fsync the part and record ``sync`` bytes as durable
        (None: nothing new to record); when ``complete``, hash it and put it in place if the
        SHA-256 matches (else drop it). The part's digest and size when hashed."""
        try:
            if sync is not None:
                make_durable(f, marker, sync, size, sha)
        finally:
            f.close()
        if not complete:
            return None
        part = f.name
        digest, n = file_sha256(part)
        if digest != sha or n != size:
            self._drop_part(part, marker)
            return digest, n
        write_json(part[:-len(".part")] + ".sha256.json", {"sha256": digest, "size": n})
        os.replace(part, self.data.file_path(cid, rank, name))
        self._drop_part(part, marker)
        return digest, n

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
