"""What every part of the service shares: the data folder, the token, the agent registry, limits."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import anyio
from starlette.requests import Request

from aiprof.server.auth import load_or_create_token
from aiprof.server.registry import Registry
from aiprof.server.store import DataDir

DEFAULT_MAX_FILE_MB = 4096
# Worker threads for the service's file work (uploads' opens, writes, fsyncs and renames, results,
# stacks): bounded, and few, so that they seldom hold the interpreter lock the event loop waits
# for. fsyncs of 8 threads keep this disk busy (~1,000 files/s on the 2-CPU test machine).
IO_THREADS = 8
T = TypeVar("T")


class ServiceContext:
    """State shared by the route groups (agents, uploads, captures, coordination, pages)."""

    def __init__(self, data_dir: str, max_file_mb: int = DEFAULT_MAX_FILE_MB, interval_s: float = 1.0,
                 public_url: str | None = None) -> None:
        self.data = DataDir(data_dir)
        self.token = load_or_create_token(self.data.root)
        self.registry = Registry(interval_s)
        self.max_file = max_file_mb << 20
        self.public_url = public_url
        self.stats = {"uploads": 0, "upload_bytes": 0, "checksum_mismatch": 0}
        self.io_limiter: Any = None  # made on the event loop, at the first call

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of IO_THREADS worker threads (file work, off the event loop)."""
        if self.io_limiter is None:
            self.io_limiter = anyio.CapacityLimiter(IO_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.io_limiter)

    def url(self, req: Request | None, path: str) -> str:
        """An absolute link for answers: ``--public-url`` if set, else as the client addressed us."""
        if self.public_url:
            return self.public_url.rstrip("/") + path
        if req is not None:
            return str(req.base_url).rstrip("/") + path
        return path
