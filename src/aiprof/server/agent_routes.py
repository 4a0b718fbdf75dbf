"""Routes the agents call: register, heartbeat (answers pending commands), results; live jobs."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import HTTPError, read_json_body
from aiprof.server.registry import TooManyAgents
from aiprof.server.store import safe_name, safe_rank
from aiprof.server.upload_routes import check_rank


class AgentRoutes:
    """``/agents``, ``/agents/{id}/heartbeat``, ``/agents/{id}/results`` and ``/jobs``."""

    def __init__(self, ctx: ServiceContext, queue: AnalysisQueue) -> None:
        self.ctx = ctx
        self.registry = ctx.registry
        self.queue = queue

    async def register(self, req: Request) -> Response:
        body = await read_json_body(req)
        aid = safe_name(str(body.get("agent_id", "")), "agent id")
        job = safe_name(str(body.get("job", "")), "job")
        peer = req.client.host if req.client else ""
        try:
            a = self.registry.register(aid, job, body, peer)
        except TooManyAgents as exc:
            raise HTTPError(429, str(exc)) from None
        except (TypeError, ValueError):
            raise HTTPError(400, "pid, rank and world_size must be integers") from None
        return JSONResponse({"agent_id": a.agent_id, "job": a.job, "interval_s": self.registry.interval})

    async def heartbeat(self, req: Request) -> Response:
        aid = safe_name(req.path_params["aid"], "agent id")
        body = await read_json_body(req)
        got = self.registry.heartbeat(aid, body)
        if got is None:
            raise HTTPError(404, "unknown agent: register again")
        _, cmds = got
        return JSONResponse({"commands": cmds, "interval_s": self.registry.interval})

    async def result(self, req: Request) -> Response:
        body = await read_json_body(req)
        cid = safe_name(str(body.get("capture_id", "")), "capture id")
        rank = safe_rank(body.get("rank"))
        rec = {k: body.get(k) for k in ("ok", "error", "steps", "phase", "dir", "host", "pid")}
        rec["at"] = time.time()
        check_rank(cid, self.ctx.data.capture_rank_set(cid)[1], rank)
        # appended to the capture's results log, not a rewrite of its state (O(ranks) per result)
        if await self.ctx.io(self.ctx.data.add_result, cid, rank, rec) is None:
            raise HTTPError(404, f"no capture {cid}")
        self.queue.rank_result(cid, rank, rec)
        return JSONResponse({"ok": True})

    async def jobs(self, req: Request) -> Response:
        now = time.time()
        out = {job: [a.public(now, self.registry.interval) for a in agents]
               for job, agents in self.registry.jobs(alive_only=req.query_params.get("all") != "1").items()}
        return JSONResponse({"jobs": out, "interval_s": self.registry.interval})
