"""The service's embedded store: one local directory, no database (docs/server.md, "Storage").

::

    DATA/
      token                          0600, created at first start
      server.json                    url and pid of the running server (for tests and scripts)
      captures/<capture-id>/
        .state.json                  job, request, expected ranks, per-rank results, analysis state
        rank<R>/trace.json.gz        uploaded files (visible only once their SHA-256 matched)
        rank<R>/trace.json.gz.aiprof/  the columnar store (Parquet), written by ingest
        rank<R>/.uploads/<name>.part   partial uploads (resume from their size)
        report/report.json, report.txt the analysis
      hang/<snapshot-id>/.state.json, rank<R>.json, hang.json

Every name that comes from a client (capture id, file name, job, snapshot id) is checked
against one strict pattern and every path is re-checked to lie under DATA, so no request can
reach outside it. State files are written atomically (temp file + rename): a restart finds
either the old or the new state, never half of one.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from typing import Any

from aiprof.server.client import NAME_RE, is_plain_name

MAX_RANK = 1 << 20
STATE = ".state.json"
# Captures whose parsed state is kept (DataDir.capture_view): those uploading now, a few at a time.
VIEWS_KEPT = 32
PART_DIR = ".uploads"
# Agents' results, one JSON line each, appended beside the state (DataDir.add_result): rewriting a
# 1,024-rank state (up to ~190 kB) on each of 1,024 results took a quarter of the event loop's time
RESULTS_LOG = ".results.jsonl"


class BadName(ValueError):
    """A client-supplied name that is not a plain, safe file name."""


def safe_name(name: str, what: str = "name") -> str:
    """``name`` if it is a plain name (letters, digits, . _ -; no '..', no '/'), else BadName."""
    if not is_plain_name(name):
        raise BadName(f"bad {what} {name!r}: use letters, digits, '.', '_' and '-' (at most 128)")
    return name


def safe_rank(rank: Any) -> int:
    """A rank number in 0..2^20."""
    try:
        r = int(rank)
    except (TypeError, ValueError):
        raise BadName(f"bad rank {rank!r}") from None
    if not 0 <= r < MAX_RANK or str(rank).strip() not in (str(r), f"+{r}"):
        raise BadName(f"bad rank {rank!r}")
    return r


def write_json(path: str, obj: Any) -> None:
    """Write JSON atomically (temp file in the same folder, then rename). Compact, in one
    json.dumps: Python's C encoder (json.dump and any indent take the pure-Python one, ~10x
    slower; a 1,024-rank capture's state is ~150 kB, rewritten on every agent's result)."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    text = json.dumps(obj, default=str, separators=(",", ":"))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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


def read_json(path: str) -> Any:
    """JSON from ``path``, or None if missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class DataDir:
    """Paths inside DATA, each checked to stay inside it."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for sub in ("captures", "hang"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        self.lock = threading.RLock()  # guards state files read-modify-write
        # captures' states as last read (capture_view): every upload and result reads its
        # capture's state, ~150 kB of JSON at 1,024 ranks; re-read only after save_capture
        self._views: dict[str, dict] = {}
        self._view_paths: dict[str, str] = {}  # their state files' paths
        # capture_rank_set: the ranks of a kept view, as a set (a view, its ranks), checked on every upload
        self._rank_sets: dict[str, tuple[dict, Any]] = {}

    def _inside(self, *parts: str) -> str:
        p = os.path.realpath(os.path.join(self.root, *parts))
        if os.path.commonpath([p, self.root]) != self.root or p == self.root:
            raise BadName(f"path escapes the data folder: {'/'.join(parts)!r}")
        return p

    # -- captures -------------------------------------------------------------------------------
    def capture_dir(self, cid: str) -> str:
        return self._inside("captures", safe_name(cid, "capture id"))

    def rank_dir(self, cid: str, rank: int) -> str:
        return self._inside("captures", safe_name(cid, "capture id"), f"rank{safe_rank(rank)}")

    def file_path(self, cid: str, rank: int, name: str) -> str:
        return self._inside("captures", safe_name(cid, "capture id"), f"rank{safe_rank(rank)}",
                            safe_name(name, "file name"))

    def part_path(self, cid: str, rank: int, name: str) -> str:
        return self._inside("captures", safe_name(cid, "capture id"), f"rank{safe_rank(rank)}", PART_DIR,
                            safe_name(name, "file name") + ".part")

    def capture_ids(self) -> list[str]:
        base = os.path.join(self.root, "captures")
        return sorted((d for d in os.listdir(base) if NAME_RE.match(d) and os.path.isfile(os.path.join(base, d, STATE))),
                      reverse=True)

    def load_capture(self, cid: str) -> dict | None:
        """The capture's state as stored: its state file with the results logged since folded in
        (a copy of one's own)."""
        d = self.capture_dir(cid)
        st = read_json(os.path.join(d, STATE))
        if not isinstance(st, dict):
            return None
        try:
            with open(os.path.join(d, RESULTS_LOG), "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return st
        except OSError:
            return st
        results = st.setdefault("results", {})
        for line in lines:  # in arrival order: a rank's last result wins
            try:
                rec = json.loads(line)
                results[str(int(rec.pop("rank")))] = rec
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a line a crash cut short
        return st

    def add_result(self, cid: str, rank: int, rec: dict) -> dict | None:
        """Record an agent's result for ``rank``: one line appended to the capture's results log
        (the state file is rewritten only when the capture's state changes, results folded in),
        and the kept view updated. None when there is no such capture."""
        line = (json.dumps({**rec, "rank": rank}, default=str, separators=(",", ":")) + "\n").encode()
        with self.lock:
            st = self.capture_view(cid)
            if st is None:
                return None
            fd = os.open(os.path.join(self.capture_dir(cid), RESULTS_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one write of a short line: whole or (a crash) cut, never interleaved
            finally:
                os.close(fd)
            st.setdefault("results", {})[str(rank)] = rec
            return st

    def capture_view(self, cid: str) -> dict | None:
        """The capture's state, parsed once per write (this process is its only writer, through
        save_capture): for the paths that only read it, on every upload and result. Shared:
        never modify it (load_capture gives a copy of one's own)."""
        with self.lock:
            kept = self._views.get(cid)
            if kept is not None and os.path.isfile(self._view_paths.get(cid, "")):
                return kept  # still there: one stat, the path checked (realpath) when it was read
            path = os.path.join(self.capture_dir(cid), STATE)
            st = self.load_capture(cid)
            if st is None:
                self._views.pop(cid, None)
                return None
            if len(self._views) >= VIEWS_KEPT:  # the oldest read first (dicts keep insertion order)
                self._views.pop(next(iter(self._views)))
            self._views[cid] = st
            self._view_paths = {k: v for k, v in self._view_paths.items() if k in self._views}
            self._view_paths[cid] = path
            return st

    def capture_rank_set(self, cid: str) -> tuple[dict | None, Any]:
        """The capture's kept view (capture_view) and the ranks it may receive files for, as a
        set or range (None: not known yet), built once per view: every upload and result asks."""
        with self.lock:
            st = self.capture_view(cid)
            if st is None:
                return None, None
            got = self._rank_sets.get(cid)
            if got is not None and got[0] is st:
                return st, got[1]
            ranks = capture_ranks(st)
            ranks = frozenset(ranks) if isinstance(ranks, list) else ranks
            if len(self._rank_sets) >= 2 * VIEWS_KEPT:  # bounded: only kept views' sets stay
                self._rank_sets = {k: v for k, v in self._rank_sets.items() if self._views.get(k) is v[0]}
            self._rank_sets[cid] = (st, ranks)
            return st, ranks

    def save_capture(self, cid: str, state: dict) -> None:
        """Write the capture's whole state (``state`` holds every result: it came from
        load_capture, capture_view or update_capture, or is new), then drop the results log it
        folded in. A crash in between leaves the log beside a state that has its lines already:
        folding them in again changes nothing."""
        with self.lock:
            self._views.pop(cid, None)
            d = self.capture_dir(cid)
            write_json(os.path.join(d, STATE), state)
            try:
                os.unlink(os.path.join(d, RESULTS_LOG))
            except FileNotFoundError:
                pass

    def update_capture(self, cid: str, fn: Any) -> dict | None:
        """Read-modify-write a capture's state under the lock; ``fn(state)`` edits in place. The
        state returned is the shared view (capture_view): read it, never modify it."""
        with self.lock:
            # the kept view, taken out while it changes (a failed edit leaves none: the next read parses)
            st = self._views.pop(cid, None)
            if st is None or not os.path.isfile(os.path.join(self.capture_dir(cid), STATE)):
                st = self.load_capture(cid)
            if st is None:
                return None
            self._rank_sets.pop(cid, None)  # fn may change the ranks (an implicit capture learns them)
            fn(st)
            self.save_capture(cid, st)
            self._views[cid] = st  # what is on disk now
            self._view_paths[cid] = os.path.join(self.capture_dir(cid), STATE)
            return st

    def uploaded_ranks(self, cid: str) -> dict[int, list[str]]:
        """rank -> complete files of a capture (a rank is complete once meta.json is there)."""
        out: dict[int, list[str]] = {}
        base = self.capture_dir(cid)
        if not os.path.isdir(base):
            return out
        for d in os.listdir(base):
            m = re.fullmatch(r"rank(\d+)", d)
            if m:
                files = sorted(f for f in os.listdir(os.path.join(base, d))
                               if NAME_RE.match(f) and os.path.isfile(os.path.join(base, d, f)))
                out[int(m.group(1))] = files
        return out

    def trace_files(self, cid: str) -> list[str]:
        """The uploaded trace of each complete rank (meta.json present), sorted by rank."""
        ranks = self.uploaded_ranks(cid)
        return [os.path.join(self.rank_dir(cid, r), "trace.json.gz") for r in sorted(ranks)
                if "meta.json" in ranks[r] and "trace.json.gz" in ranks[r]]

    # -- hang snapshots -------------------------------------------------------------------------
    def hang_dir(self, sid: str) -> str:
        return self._inside("hang", safe_name(sid, "snapshot id"))

    def hang_ids(self) -> list[str]:
        base = os.path.join(self.root, "hang")
        return sorted((d for d in os.listdir(base) if NAME_RE.match(d)), reverse=True)
