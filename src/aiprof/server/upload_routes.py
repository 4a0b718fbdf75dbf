"""Resumable, checksummed uploads of capture files (docs/server.md, "Uploads").

``GET .../files/{name}`` says how many bytes the server holds; ``PUT ...?offset=O&size=S&sha256=H``
appends from O to ``rank<R>/.uploads/<name>.part``. When S bytes are in, the part is hashed and
renamed into place only if the SHA-256 matches. Uploads to one file are serialised.
"""
from __future__ import annotations

import asyncio
import os
import re
import time

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.client import file_sha256
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import HTTPError
from aiprof.server.store import read_json, safe_name, safe_rank, write_json

MAX_FILES_PER_RANK = 16
SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class UploadRoutes:
    """``GET|PUT /captures/{cid}/ranks/{r}/files/{name}``."""

    def __init__(self, ctx: ServiceContext, queue: AnalysisQueue) -> None:
        self.ctx = ctx
        self.data = ctx.data
        self.queue = queue
        self.file_locks: dict[tuple, asyncio.Lock] = {}

    def _file_status(self, cid: str, rank: int, name: str) -> dict:
        final = self.data.file_path(cid, rank, name)
        if os.path.isfile(final):
            sha = read_json(self.data.part_path(cid, rank, name)[:-len(".part")] + ".sha256.json") or {}
            return {"complete": True, "received": os.path.getsize(final), "sha256": sha.get("sha256")}
        part = self.data.part_path(cid, rank, name)
        return {"complete": False, "received": os.path.getsize(part) if os.path.isfile(part) else 0}

    async def file_status(self, req: Request) -> Response:
        p = req.path_params
        return JSONResponse(self._file_status(p["cid"], safe_rank(p["rank"]), p["name"]))

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
        key = (cid, rank, name)
        lock = self.file_locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._receive(req, cid, rank, name, offset, size, sha)
        finally:
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self.file_locks.pop(key, None)

    async def _receive(self, req: Request, cid: str, rank: int, name: str, offset: int, size: int, sha: str) -> Response:
        st = self._file_status(cid, rank, name)
        if st["complete"]:
            if st.get("sha256") == sha:
                return JSONResponse(st)
            raise HTTPError(409, f"{name} of rank {rank} is already complete with another checksum")
        if offset != st["received"]:
            raise HTTPError(409, f"offset {offset} does not match the {st['received']} bytes held", received=st["received"])
        self._ensure_capture(cid, req.query_params.get("job"))
        rdir = self.data.rank_dir(cid, rank)
        if not os.path.isdir(rdir) or name not in os.listdir(rdir):
            existing = [f for f in (os.listdir(rdir) if os.path.isdir(rdir) else []) if not f.startswith(".")]
            if len(existing) >= MAX_FILES_PER_RANK:
                raise HTTPError(413, f"rank {rank} already has {len(existing)} files")
        part = self.data.part_path(cid, rank, name)
        os.makedirs(os.path.dirname(part), exist_ok=True)
        received = offset
        over = False
        f = open(part, "ab")
        try:
            async for chunk in req.stream():
                if received + len(chunk) > size:
                    over = True
                    break
                f.write(chunk)
                received += len(chunk)
        except ClientDisconnect:  # keep what arrived: the client resumes from it
            return JSONResponse({"complete": False, "received": received})
        finally:
            f.close()
        if over:
            os.unlink(part)
            raise HTTPError(413, f"more bytes than the declared size {size}")
        if received < size:
            return JSONResponse({"complete": False, "received": received})
        digest, n = await anyio.to_thread.run_sync(file_sha256, part)
        if digest != sha or n != size:
            os.unlink(part)
            self.ctx.stats["checksum_mismatch"] += 1
            raise HTTPError(422, f"checksum mismatch for {name}: got {digest}, expected {sha}; send it again")
        write_json(part[:-len(".part")] + ".sha256.json", {"sha256": digest, "size": n})
        os.replace(part, self.data.file_path(cid, rank, name))
        self.ctx.stats["uploads"] += 1
        self.ctx.stats["upload_bytes"] += n
        if name == "meta.json":
            self.queue.check_complete(cid)
        return JSONResponse({"complete": True, "received": n, "sha256": digest})

    def _ensure_capture(self, cid: str, job: str | None) -> None:
        """An upload for a capture the server did not trigger (``aiprof run --server --iterations``)."""
        with self.data.lock:
            if self.data.load_capture(cid) is None:
                os.makedirs(self.data.capture_dir(cid), exist_ok=True)
                self.data.save_capture(cid, {"capture_id": cid, "job": safe_name(job, "job") if job else None,
                                             "created": time.time(), "expected": None, "results": {},
                                             "deadline": time.time() + 600, "auto_analyze": True,
                                             "state": "capturing", "source": "agent"})
                self.queue.active.add(cid)
