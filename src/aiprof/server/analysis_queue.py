"""Captures from ``capturing`` to ``analysed``: completion of uploads, then one analysis at a time.

A capture is ``uploaded`` once every expected rank's meta.json arrived or reported a failure
(or at its deadline, with what arrived); with ``auto_analyze`` the analysis follows. Analysis
runs ``aiprof analyze`` in a child process, one at a time: the event loop never holds the GIL
for seconds, and a crash in analysis cannot take the server down. A large job is analysed rank
by rank on Ray by that child (a local Ray, or the server's ``--cluster``; docs/scale.md); it
keeps ``report/progress.json`` up to date, which the capture's state shows while it runs.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Callable

from aiprof.server.context import ServiceContext
from aiprof.server.store import capture_ranks, read_json

ANALYSIS_TIMEOUT_S = 1800
PROGRESS_FILE = "progress.json"  # in the capture's report folder, written by `aiprof analyze --progress-file`


def implicit_ranks(metas: dict[int, dict]) -> list[int] | None:
    """The ranks a capture the server did not trigger waits for, from its ranks' meta.json.

    A capture one rank took by itself (the auto-trigger: ``trigger.scope == "rank"``, its own
    capture id) is that rank alone; one that every rank of the job took under one id
    (``aiprof run --iterations``) waits for the world size.
    """
    if not metas:
        return None
    if any((m.get("trigger") or {}).get("scope") == "rank" for m in metas.values()):
        return sorted(metas)
    return list(range(max(int(m.get("world_size") or 1) for m in metas.values())))


class AnalysisQueue:
    """Watches captures still waiting for ranks and runs their analyses (one child at a time)."""

    def __init__(self, ctx: ServiceContext, on_analysed: Callable[[str], None], cluster: str | None = None) -> None:
        self.ctx = ctx
        self.cluster = cluster
        self.data = ctx.data
        self.on_analysed = on_analysed  # e.g. drop a UI app that shows the old report
        self.analysing: set[str] = set()
        # captures still waiting for ranks: the ticker looks at these only, not at every capture ever stored
        self.active: set[str] = set()
        # their complete ranks, kept as meta.json files arrive: listing every rank's folder on each
        # arrival is quadratic (1,024 ranks: ~10^6 stats on the event loop)
        self.done_ranks: dict[str, set[int]] = {}
        # the ranks each still waits for (expected, neither complete nor failed), once its ranks are
        # known: every arrival and result takes one out, so checking completion is O(1), not O(ranks)
        self.pending: dict[str, set[int]] = {}
        self.sem: asyncio.Semaphore | None = None

    def start(self) -> None:
        """On the event loop, at server start: queue what a restart interrupted."""
        self.sem = asyncio.Semaphore(1)
        for cid in self.data.capture_ids():
            st = self.data.load_capture(cid) or {}
            if st.get("state") == "capturing":
                self.active.add(cid)
            if st.get("state") == "analysing" or (st.get("state") == "uploaded" and st.get("auto_analyze")):
                self.start_analysis(cid)

    def tick(self) -> None:
        for cid in sorted(self.active):
            self.check_complete(cid)

    def rank_complete(self, cid: str, rank: int) -> None:
        """A rank's meta.json arrived (its upload is complete): note it, then check the capture."""
        if cid in self.done_ranks:
            self.done_ranks[cid].add(rank)
        if cid in self.pending:
            self.pending[cid].discard(rank)
        self.check_complete(cid)

    def rank_result(self, cid: str, rank: int, rec: dict) -> None:
        """A rank's result was recorded: a failure is one rank less to wait for; check the capture."""
        pending = self.pending.get(cid)
        if pending is not None:
            if rec.get("ok") is False:
                pending.discard(rank)
            else:  # a later result that is not a failure: waited for again unless its files are in
                self.pending.pop(cid)
        self.check_complete(cid)

    def _forget(self, cid: str) -> None:
        self.active.discard(cid)
        self.done_ranks.pop(cid, None)
        self.pending.pop(cid, None)

    def _pending(self, cid: str, st: dict) -> set[int] | None:
        """The ranks ``cid`` still waits for; None while its ranks are not known (an implicit
        capture before its first meta.json). Built once from the state, then kept."""
        pending = self.pending.get(cid)
        if pending is None:
            ranks = capture_ranks(st)
            if ranks is None:
                return None
            failed = {int(r) for r, res in (st.get("results") or {}).items() if res.get("ok") is False}
            pending = self.pending[cid] = set(ranks) - self._done(cid) - failed
        return pending

    def _done(self, cid: str) -> set[int]:
        """The capture's complete ranks: listed from disk once (or after a restart), then kept."""
        done = self.done_ranks.get(cid)
        if done is None:
            ranks = self.data.uploaded_ranks(cid)
            done = self.done_ranks[cid] = {r for r, files in ranks.items() if "meta.json" in files}
        return done

    def check_complete(self, cid: str) -> None:
        """capturing -> uploaded when every expected rank has its files or reported a failure
        (or at the deadline, with what arrived); then the analysis starts if asked for."""
        st = self.data.capture_view(cid)  # read only: on every meta.json and result
        if not st or st.get("state") != "capturing":
            self._forget(cid)
            return
        # O(1) on each arrival: the ranks still waited for are kept (a 1,024-rank capture made
        # this O(ranks) per arrival, and an implicit one read every rank's meta.json per arrival)
        pending = self._pending(cid, st)
        metas: dict[int, dict] | None = None  # read only when needed
        expected: list[int] | range | None = None
        if pending is None:  # ranks not known: a capture the server did not trigger, its meta.json says
            metas = self._metas(cid, self._done(cid))
            expected = implicit_ranks(metas)
            failed = {int(r) for r, res in (st.get("results") or {}).items() if res.get("ok") is False}
            complete = expected is not None and set(expected) <= self._done(cid) | failed
        else:
            complete = not pending
        if not complete and time.time() < st.get("deadline", 0):
            return
        done = set(self._done(cid))
        if metas is None:
            metas = self._metas(cid, done)
        if pending is not None:
            expected = capture_ranks(st)

        def upd(s: dict) -> None:
            if s.get("state") != "capturing":
                return
            s["received"] = sorted(done)
            s["missing"] = sorted(set(expected or []) - done)
            s["state"] = "uploaded" if done else "failed"
            if not done:
                s["error"] = "no rank's capture arrived before the deadline"
            s["steps_by_rank"] = {str(r): (m.get("steps") or {}).get("captured") for r, m in metas.items()}
            if metas and not s.get("trigger"):  # why it was taken (auto-trigger: slowdown, ...)
                s["trigger"] = next(iter(metas.values())).get("trigger")
            steps = [tuple(v or ()) for v in s["steps_by_rank"].values()]
            s["aligned"] = bool(steps) and all(x == steps[0] for x in steps)
        st = self.data.update_capture(cid, upd)
        self._forget(cid)
        if st and st.get("state") == "uploaded" and st.get("auto_analyze"):
            self.start_analysis(cid)

    def _metas(self, cid: str, ranks: set[int]) -> dict[int, dict]:
        return {r: read_json(os.path.join(self.data.rank_dir(cid, r), "meta.json")) or {} for r in sorted(ranks)}

    def start_analysis(self, cid: str) -> bool:
        """Queue the analysis of ``cid`` (False when it is queued or running already)."""
        if cid in self.analysing:
            return False
        self.analysing.add(cid)
        self.data.update_capture(cid, lambda s: s.update(state="analysing", analysis={"queued": time.time()}))
        asyncio.get_running_loop().create_task(self._analyse(cid))
        return True

    async def _analyse(self, cid: str) -> None:
        assert self.sem is not None
        try:
            async with self.sem:
                files = self.data.trace_files(cid)
                out = os.path.join(self.data.capture_dir(cid), "report")
                os.makedirs(out, exist_ok=True)
                t0 = time.time()
                err = None
                if not files:
                    err = "no complete rank to analyse"
                else:
                    progress = os.path.join(out, PROGRESS_FILE)
                    if os.path.exists(progress):
                        os.unlink(progress)  # an earlier analysis's
                    extra = ["--cluster", self.cluster] if self.cluster else []
                    with open(os.path.join(out, "analyze.log"), "wb") as log:
                        proc = await asyncio.create_subprocess_exec(
                            sys.executable, "-m", "aiprof", "analyze", *files, "--out", out, "--progress-file",
                            progress, *extra, stdout=log, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
                        try:
                            rc = await asyncio.wait_for(proc.wait(), ANALYSIS_TIMEOUT_S)
                        except asyncio.TimeoutError:
                            proc.kill()
                            await proc.wait()
                            rc = -9
                    if rc != 0 or not os.path.isfile(os.path.join(out, "report.json")):
                        with open(os.path.join(out, "analyze.log"), errors="replace") as f:
                            tail = f.read()[-2000:].strip().splitlines()
                        err = f"aiprof analyze exited {rc}: {tail[-1] if tail else ''}"
                rep = read_json(os.path.join(out, "report.json")) if err is None else None
                summary = None
                if rep:
                    summary = {"ranks": rep.get("capture", {}).get("ranks_found"),
                               "causes": [{"code": c.get("code"), "severity": c.get("severity"), "title": c.get("title"),
                                           "rank": c.get("rank"),
                                           "per_step_ms": (c.get("saving") or {}).get("per_step_us", 0.0) / 1000.0}
                                          for c in (rep.get("causes") or [])[:20]]}

                def upd(s: dict) -> None:
                    s["state"] = "analysed" if err is None else "failed"
                    s["analysis"] = {"started": t0, "finished": time.time(), "error": err, "summary": summary}
                    if err:
                        s["error"] = err
                self.data.update_capture(cid, upd)
                self.on_analysed(cid)  # the next UI visit opens the fresh report
        finally:
            self.analysing.discard(cid)
