"""The durable outbox: captures waiting to be uploaded to the central service, marked on disk.

A finished capture's rank folder (``<out>/<capture-id>/rank<R>/``) gets a small
``.pending-upload`` marker (JSON: server, capture id, rank, job) as soon as the agent knows a
server is configured. A successful upload replaces it with ``.uploaded`` (the server's base
URL and the time); a server that refuses the capture for good (4xx: too large, bad name)
replaces it with ``.upload-refused`` and the reason. So a capture whose upload did not finish
while its job lived (server down, job exited, queue full) is still marked, and is sent by the
next agent that starts on this host with the same server and ``--out`` (for its own rank), or
by ``aiprof upload DIR``.

Uploads are the client's: streamed, SHA-256 checked by the server before a file becomes
visible, resumed from what the server already holds; the server treats a complete file sent
again as a no-op, so two uploaders of one folder store it once. Standard library only (it
runs inside users' jobs).
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator

from aiprof.server.client import ServerClient, is_plain_name

PENDING = ".pending-upload"
UPLOADED = ".uploaded"
REFUSED = ".upload-refused"
CAPTURE_SCHEMA = "aiprof.capture/1"  # meta.json of a trace capture (not a stack snapshot)
MAX_SCAN = 10_000  # rank folders looked at per scan: a huge --out folder cannot stall a scan
_RANK_RE = re.compile(r"rank(\d+)")


@dataclass
class RankDir:
    """One capture folder of one rank, as found on disk."""

    path: str
    capture_id: str
    rank: int
    job: str | None = None
    server: str | None = None  # the server named in its .pending-upload marker, if any


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def mark_pending(d: str, server: str, capture_id: str, rank: int, job: str | None) -> None:
    """Mark rank folder ``d`` as waiting for an upload to ``server`` (atomic; raises OSError)."""
    _write(os.path.join(d, PENDING), json.dumps({"server": server, "capture_id": capture_id, "rank": rank,
                                                 "job": job, "created": time.time()}))


def mark_uploaded(d: str, server: str) -> None:
    """Record that ``d`` is on ``server`` and drop its pending marker."""
    _write(os.path.join(d, UPLOADED), f"{server} {time.time():.0f}\n")
    _unlink(os.path.join(d, PENDING))


def mark_refused(d: str, server: str, error: str) -> None:
    """Record that ``server`` refused ``d`` for good (retrying cannot help) and drop its pending marker."""
    _write(os.path.join(d, REFUSED), json.dumps({"server": server, "error": error, "at": time.time()}))
    _unlink(os.path.join(d, PENDING))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def uploaded_to(d: str) -> str | None:
    """The server base URL that ``d`` was uploaded to, or None."""
    try:
        with open(os.path.join(d, UPLOADED)) as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def is_capture(d: str) -> bool:
    """True for a complete trace capture folder (meta.json of schema aiprof.capture/1)."""
    meta = _read_marker(os.path.join(d, "meta.json"))
    return bool(meta) and meta.get("schema") == CAPTURE_SCHEMA


def rank_dirs(root: str) -> Iterator[str]:
    """rank<R> folders at ``root`` (a rank folder), one level down (a capture) or two (an --out folder)."""
    root = os.path.abspath(root)
    if _RANK_RE.fullmatch(os.path.basename(root)):
        yield root
        return
    n = 0
    for depth1 in sorted(_listdirs(root)):
        if _RANK_RE.fullmatch(os.path.basename(depth1)):
            yield depth1
            n += 1
            continue
        for depth2 in sorted(_listdirs(depth1)):
            if _RANK_RE.fullmatch(os.path.basename(depth2)):
                yield depth2
                n += 1
        if n >= MAX_SCAN:
            return


def _listdirs(d: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def describe(d: str) -> RankDir | None:
    """The capture id, rank and job of rank folder ``d`` (from its marker, else its path), or None."""
    m = _RANK_RE.fullmatch(os.path.basename(d))
    cid = os.path.basename(os.path.dirname(d))
    if not m or not is_plain_name(cid):
        return None
    mk = _read_marker(os.path.join(d, PENDING)) or {}
    return RankDir(d, str(mk.get("capture_id") or cid), int(m.group(1)), mk.get("job"), mk.get("server"))


def pending(root: str, server: str | None = None, rank: int | None = None) -> list[RankDir]:
    """Rank folders under ``root`` with a pending marker (for ``server`` and ``rank`` when given)."""
    out = []
    for d in rank_dirs(root):
        if not os.path.isfile(os.path.join(d, PENDING)):
            continue
        rd = describe(d)
        if rd is None or (server and rd.server != server) or (rank is not None and rd.rank != rank):
            continue
        out.append(rd)
    return out


def upload_rank_dir(client: ServerClient, rd: RankDir, timeout: float = 120.0) -> list[Any]:
    """Upload one rank folder's files, meta.json last (its arrival marks the rank complete).

    The server learns the capture's ranks from meta.json's world size and trigger scope, and
    refuses a rank outside them. Marks the folder uploaded when every file is in. Raises
    ServerError (the marker stays).
    """
    names = sorted(f for f in os.listdir(rd.path) if is_plain_name(f)
                   and os.path.isfile(os.path.join(rd.path, f)))
    names.sort(key=lambda n: n == "meta.json")
    meta = _read_marker(os.path.join(rd.path, "meta.json")) or {}
    world = meta.get("world_size") if isinstance(meta.get("world_size"), int) else None
    scope = (meta.get("trigger") or {}).get("scope") if isinstance(meta.get("trigger"), dict) else None
    out = [client.upload_file(rd.capture_id, rd.rank, os.path.join(rd.path, n), n, attempts=3, timeout=timeout,
                              job=rd.job, world_size=world, scope=scope) for n in names]
    try:
        mark_uploaded(rd.path, client.base)
    except OSError:
        pass  # read-only folder: the server holds it anyway; a later scan finds nothing pending
    return out
