"""Job-wide commands: one capture of the same iterations on every rank, one stack snapshot of all.

The start iteration (or wall-clock start for duration captures) is planned by
server/registry.py; the command reaches every agent of the job in its next heartbeat answer.
Stack snapshots are collected per rank and grouped by analysis/hang.py once every rank
answered or the snapshot's timeout passed.
"""
from __future__ import annotations

import os
import re
import time

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiprof.protocol import CaptureRequest
from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import HTTPError, read_json_body
from aiprof.server.registry import AgentInfo, new_id, plan_start, plan_start_time
from aiprof.server.store import STATE, read_json, safe_name, safe_rank, write_json

MAX_STACKS_JSON = 8 << 20


class JobCoordination:
    """``POST /jobs/{job}/captures``, ``/jobs/{job}/hang`` and the hang snapshots' collection."""

    def __init__(self, ctx: ServiceContext, queue: AnalysisQueue) -> None:
        self.ctx = ctx
        self.data = ctx.data
        self.registry = ctx.registry
        self.queue = queue
        self.active_hang: set[str] = set()  # snapshots still collecting
        # a collecting snapshot's state and the ranks whose stacks arrived, kept as they arrive:
        # reading the state and listing the folder on each arrival is quadratic (1,024 ranks:
        # ~500 k folder entries read on the event loop)
        self.hang_states: dict[str, dict] = {}
        self.hang_have: dict[str, set[int]] = {}

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
            start_at = plan_start(agents, r.skip, interval)
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
        self.hang_states[sid], self.hang_have[sid] = st, set()
        self.registry.send(agents, {"op": "stacks", "snapshot_id": sid})
        return JSONResponse({"snapshot_id": sid, "ranks": st["expected"],
                             "status": self.ctx.url(req, f"/api/v1/hang/{sid}")})

    async def hang_upload(self, req: Request) -> Response:
        sid = safe_name(req.path_params["sid"], "snapshot id")
        rank = safe_rank(req.path_params["rank"])
        d = self.data.hang_dir(sid)
        st = self._hang_state(sid)
        if st is None:
            raise HTTPError(404, f"no snapshot {sid}")
        if rank not in st.get("expected", [rank]):
            raise HTTPError(400, f"rank {rank} is not part of snapshot {sid} (its ranks: "
                                 f"{', '.join(map(str, st['expected'])) or 'none'})")
        body = await read_json_body(req, MAX_STACKS_JSON)
        body["rank"] = rank
        await anyio.to_thread.run_sync(write_json, os.path.join(d, f"rank{rank}.json"), body)
        if sid in self.hang_have:
            self.hang_have[sid].add(rank)
        await self._check_hang(sid)
        return JSONResponse({"ok": True})

    def _hang_state(self, sid: str) -> dict | None:
        """A snapshot's state: kept in memory while it collects, else read from its folder."""
        st = self.hang_states.get(sid)
        if st is None:
            st = read_json(os.path.join(self.data.hang_dir(sid), STATE))
            if st is not None and st.get("state") == "collecting" and sid in self.active_hang:
                self.hang_states[sid] = st  # after a restart: read once
        return st

    def _hang_ranks(self, sid: str) -> set[int]:
        """The ranks whose stacks arrived: listed from the folder once (or after a restart), then kept."""
        have = self.hang_have.get(sid)
        if have is None:
            d = self.data.hang_dir(sid)
            have = self.hang_have[sid] = {int(m.group(1)) for f in os.listdir(d)
                                          if (m := re.fullmatch(r"rank(\d+)\.json", f))}
        return have

    def _forget_hang(self, sid: str) -> None:
        self.active_hang.discard(sid)
        self.hang_states.pop(sid, None)
        self.hang_have.pop(sid, None)

    async def _check_hang(self, sid: str) -> None:
        d = self.data.hang_dir(sid)
        st = self._hang_state(sid)
        if not st or st.get("state") != "collecting" or sid not in self.active_hang:
            self._forget_hang(sid)
            return
        have = set(self._hang_ranks(sid))
        if not set(st["expected"]) <= have and time.time() < st["deadline"]:
            return
        st = {**st, "state": "analysing"}
        write_json(os.path.join(d, STATE), st)
        self._forget_hang(sid)

        def analyse() -> dict:
            from aiprof.analysis.hang import analyse as hang_analyse, format_text

            procs = [read_json(os.path.join(d, f"rank{r}.json")) for r in sorted(have)]  # off the event loop
            res = hang_analyse([p for p in procs if p])
            res["missing_ranks"] = sorted(set(st["expected"]) - have)
            res["text"] = format_text(res)
            return res

        try:
            res = await anyio.to_thread.run_sync(analyse)
            write_json(os.path.join(d, "hang.json"), res)
            st["state"] = "analysed"
        except Exception as exc:
            st.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        write_json(os.path.join(d, STATE), st)

    async def hang_status(self, req: Request) -> Response:
        d = self.data.hang_dir(req.path_params["sid"])
        st = read_json(os.path.join(d, STATE))
        if st is None:
            raise HTTPError(404, "no such snapshot")
        if st.get("state") == "analysed":
            st["result"] = read_json(os.path.join(d, "hang.json"))
        return JSONResponse(st)
