"""Job-wide commands: one capture of the same iterations on every rank, one stack snapshot of all.

The start iteration (or wall-clock start for duration captures) is planned by
server/registry.py; the command reaches every agent of the job in its next heartbeat answer.
Stack snapshots are collected per rank and grouped by analysis/hang.py once every rank
answered or the snapshot's timeout passed.
"""
from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiprof.protocol import CaptureRequest, pm_lead_s
from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import HTTPError, read_json_body, read_json_body_sized
from aiprof.server.registry import AgentInfo, new_id, plan_start, plan_start_time
from aiprof.server.store import STATE, read_json, safe_name, safe_rank, write_json

MAX_STACKS_JSON = 8 << 20
# Ranks' stacks kept in memory while their snapshot collects, over all snapshots (bytes of JSON;
# a rank's is ~2-50 kB): the snapshot is assembled from memory, the rest read back from their files.
HANG_KEEP_BYTES = 32 << 20


@dataclass
class Collecting:
    """A snapshot while its ranks' stacks arrive: each arrival is O(1), nothing is listed."""

    state: dict  # as written when it was triggered (never modified: it is rewritten at assembly)
    have: set[int]  # the ranks whose stacks arrived
    expected: frozenset[int] = frozenset()
    pending: set[int] = field(default_factory=set)  # expected, not arrived yet
    procs: dict[int, dict] = field(default_factory=dict)  # stacks kept in memory (HANG_KEEP_BYTES)
    kept: dict[int, int] = field(default_factory=dict)  # their sizes
    first: float | None = None  # wall-clock time of the first and the last arrival
    last: float | None = None

    def __post_init__(self) -> None:
        self.expected = frozenset(int(r) for r in self.state.get("expected") or ())
        self.pending = set(self.expected) - self.have

    def arrived(self, rank: int, now: float) -> None:
        self.have.add(rank)
        self.pending.discard(rank)
        self.first = now if self.first is None else self.first
        self.last = now


class JobCoordination:
    """``POST /jobs/{job}/captures``, ``/jobs/{job}/hang`` and the hang snapshots' collection."""

    def __init__(self, ctx: ServiceContext, queue: AnalysisQueue) -> None:
        self.ctx = ctx
        self.data = ctx.data
        self.registry = ctx.registry
        self.queue = queue
        self.active_hang: set[str] = set()  # snapshots still collecting
        # a collecting snapshot as its ranks arrive (Collecting): its state, the ranks still
        # awaited and the stacks themselves, so an arrival is O(1) and the snapshot is assembled
        # from memory. Reading the state and listing the folder on each arrival was quadratic
        # (1,024 ranks: ~500 k folder entries read on the event loop).
        self.collecting: dict[str, Collecting] = {}
        self.hang_kept = 0  # bytes of stacks kept in memory over all snapshots (HANG_KEEP_BYTES)
        self.analyses: set[asyncio.Task] = set()  # snapshots being analysed (referenced until done)

    def start(self) -> None:
        """At server start: snapshots a restart interrupted are analysed with what arrived."""
        for sid in self.data.hang_ids():
            path = os.path.join(self.data.hang_dir(sid), STATE)
            hs = read_json(path) or {}
            if hs.get("state") in ("collecting", "analysing"):
                write_json(path, {**hs, "state": "collecting"})
                self.active_hang.add(sid)

    async def tick(self) -> None:
        for sid in sorted(self.active_hang):
            await self._check_hang(sid)

    def job_agents(self, job: str) -> list[AgentInfo]:
        """The live agents of ``job``; 404 when none, 409 when two claim one rank."""
        job = safe_name(job, "job")
        agents = self.registry.job_agents(job)
        if not agents:
            known = ", ".join(sorted(self.registry.jobs())) or "none"
            raise HTTPError(404, f"no live agents of job {job!r} (live jobs: {known})")
        ranks = [a.rank for a in agents]
        if len(set(ranks)) != len(ranks):
            raise HTTPError(409, f"job {job!r} has two agents for one rank ({sorted(ranks)}): "
                                 "a stale process, or two jobs with one job id; set AIPROF_JOB")
        return agents

    async def trigger_capture(self, req: Request) -> Response:
        body = await read_json_body(req)
        agents = self.job_agents(req.path_params["job"])
        raw = dict(body.get("request") or {})
        cid = safe_name(str(raw.get("capture_id") or new_id()), "capture id")
        if os.path.exists(self.data.capture_dir(cid)):
            raise HTTPError(409, f"capture {cid} exists")
        raw["capture_id"] = cid
        raw["out"] = "server"  # the agent writes to its own --out; this one is never used
        raw["trigger"] = raw.get("trigger") or {"reason": "server", "job": req.path_params["job"]}  # into meta.json
        r = CaptureRequest.from_dict(raw)
        interval = self.registry.interval
        start_at = start_ns = None
        if r.duration_ms is not None and r.iterations is None:
            start_ns = plan_start_time(interval)
        elif r.start_at is None:
            start_at = plan_start(agents, r.skip, interval,
                                  lead_s=pm_lead_s(r.what, r.hw_pm_interval_us, all(a.pm_ready or a.pm_off for a in agents),
                                                   all(a.pm_off for a in agents)))
            r.start_at = start_at
        timeout = max(10.0, min(float(body.get("timeout_s") or 300.0), 3600.0))
        state = {"capture_id": cid, "job": agents[0].job, "created": time.time(), "request": r.to_dict(),
                 "start_at": start_at, "start_unix_ns": start_ns, "expected": sorted(a.rank for a in agents),
                 "agents": {str(a.rank): {"agent_id": a.agent_id, "host": a.host, "pid": a.pid} for a in agents},
                 "deadline": time.time() + timeout, "auto_analyze": bool(body.get("auto_analyze", True)),
                 "results": {}, "state": "capturing", "source": "trigger", "trigger": r.trigger}
        os.makedirs(self.data.capture_dir(cid), exist_ok=True)
        self.data.save_capture(cid, state)
        self.queue.active.add(cid)
        self.registry.send(agents, {"op": "capture", "capture_id": cid, "request": r.to_dict(),
                                    "start_unix_ns": start_ns})
        return JSONResponse({"capture_id": cid, "job": state["job"], "ranks": state["expected"], "start_at": start_at,
                             "start_unix_ns": start_ns, "url": self.ctx.url(req, f"/captures/{cid}/"),
                             "status": self.ctx.url(req, f"/api/v1/captures/{cid}")})

    async def trigger_hang(self, req: Request) -> Response:
        body = await read_json_body(req)
        agents = self.job_agents(req.path_params["job"])
        sid = new_id("hang-")
        timeout = max(2.0, min(float(body.get("timeout_s") or 15.0), 300.0))
        st = {"snapshot_id": sid, "job": agents[0].job, "created": time.time(), "deadline": time.time() + timeout,
              "expected": sorted(a.rank for a in agents), "state": "collecting"}
        write_json(os.path.join(self.data.hang_dir(sid), STATE), st)
        self.active_hang.add(sid)
        self.collecting[sid] = Collecting(st, set())
        self.registry.send(agents, {"op": "stacks", "snapshot_id": sid})
        return JSONResponse({"snapshot_id": sid, "ranks": st["expected"],
                             "status": self.ctx.url(req, f"/api/v1/hang/{sid}")})

    async def hang_upload(self, req: Request) -> Response:
        sid = safe_name(req.path_params["sid"], "snapshot id")
        rank = safe_rank(req.path_params["rank"])
        d = self.data.hang_dir(sid)
        c = self._collecting(sid)
        st = c.state if c is not None else read_json(os.path.join(d, STATE))  # not collecting: a late arrival
        if st is None:
            raise HTTPError(404, f"no snapshot {sid}")
        expected = c.expected if c is not None else set(st.get("expected", [rank]))
        if rank not in expected:
            raise HTTPError(400, f"rank {rank} is not part of snapshot {sid} (its ranks: "
                                 f"{', '.join(map(str, sorted(expected))) or 'none'})")
        body, nbytes = await read_json_body_sized(req, MAX_STACKS_JSON)
        body["rank"] = rank
        await self.ctx.io(write_json, os.path.join(d, f"rank{rank}.json"), body)
        c = self.collecting.get(sid)  # still collecting after the write (the deadline may have passed)
        if c is not None and c.state.get("state") == "collecting":
            c.arrived(rank, time.time())
            self.hang_kept -= c.kept.pop(rank, 0)  # a rank that sent twice: its last stacks count
            c.procs.pop(rank, None)
            if self.hang_kept + nbytes <= HANG_KEEP_BYTES:
                c.procs[rank] = body  # assembled from memory; past the budget, read back from its file
                c.kept[rank] = nbytes
                self.hang_kept += nbytes
            if not c.pending:
                self._assemble(sid)  # the last rank: analysed on its own task, this answer does not wait
        return JSONResponse({"ok": True})

    def _collecting(self, sid: str) -> Collecting | None:
        """A collecting snapshot's record; after a restart rebuilt once from its folder."""
        c = self.collecting.get(sid)
        if c is None and sid in self.active_hang:
            d = self.data.hang_dir(sid)
            st = read_json(os.path.join(d, STATE))
            if st is None or st.get("state") != "collecting":
                self.active_hang.discard(sid)
                return None
            have = {int(m.group(1)) for f in os.listdir(d) if (m := re.fullmatch(r"rank(\d+)\.json", f))}
            c = self.collecting[sid] = Collecting(st, have)
        return c

    def _release(self, c: Collecting) -> dict[int, dict]:
        """The stacks ``c`` kept in memory, handed over (and their budget freed)."""
        procs = c.procs
        self.hang_kept -= sum(c.kept.values())
        c.procs, c.kept = {}, {}
        return procs

    async def _check_hang(self, sid: str) -> None:
        """On each tick: a snapshot past its deadline (or complete) is assembled with what arrived."""
        c = self._collecting(sid)
        if c is None:
            self.active_hang.discard(sid)
            return
        if c.pending and time.time() < c.state["deadline"]:
            return
        self._assemble(sid)

    def _assemble(self, sid: str) -> None:
        """Stop collecting ``sid`` and analyse it on a task of its own (state "analysing" at once)."""
        c = self.collecting.pop(sid)
        self.active_hang.discard(sid)
        st = {**c.state, "state": "analysing"}
        procs = self._release(c)
        have = set(c.have)
        task = asyncio.get_running_loop().create_task(self._analyse(sid, st, have, procs, c))
        self.analyses.add(task)
        task.add_done_callback(self.analyses.discard)

    async def _analyse(self, sid: str, st: dict, have: set[int], kept: dict[int, dict], c: Collecting) -> None:
        d = self.data.hang_dir(sid)
        t0 = time.time()

        def analyse() -> dict:  # off the event loop: the stacks not kept in memory are read back
            from aiprof.analysis.hang import analyse as hang_analyse, format_text

            write_json(os.path.join(d, STATE), st)
            procs = [kept.get(r) or read_json(os.path.join(d, f"rank{r}.json")) for r in sorted(have)]
            res = hang_analyse([p for p in procs if p])
            res["missing_ranks"] = sorted(set(st["expected"]) - have)
            res["text"] = format_text(res)
            write_json(os.path.join(d, "hang.json"), res)
            return res

        try:
            await anyio.to_thread.run_sync(analyse)
            st["state"] = "analysed"
        except Exception as exc:
            st.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        # how it went: first and last arrival, and the assembly after the last (or the deadline)
        st["timing"] = {"first_arrival": c.first, "last_arrival": c.last, "assembled_s": round(time.time() - t0, 4),
                        "kept_in_memory": len(kept), "read_back": len(have) - len(kept)}
        await self.ctx.io(write_json, os.path.join(d, STATE), st)

    async def hang_status(self, req: Request) -> Response:
        d = self.data.hang_dir(req.path_params["sid"])
        st = read_json(os.path.join(d, STATE))
        if st is None:
            raise HTTPError(404, "no such snapshot")
        if st.get("state") == "analysed":
            st["result"] = read_json(os.path.join(d, "hang.json"))
        return JSONResponse(st)
