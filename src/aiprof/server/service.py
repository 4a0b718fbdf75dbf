"""The central service (``aiprof server``): agent registry, job-wide triggers, uploads, analysis, UI.

One Starlette app on uvicorn, state on disk in DATA (server/store.py). Routes (all under the
token, server/auth.py; JSON in and out; documented in docs/server.md), by the module that
serves them:

=======  ==============================================  ==================================
POST     /api/v1/agents                                  agent_routes: register (idempotent)
POST     /api/v1/agents/{id}/heartbeat                   agent_routes: iteration count; pending commands
POST     /api/v1/agents/{id}/results                     agent_routes: an agent's outcome of a command
GET      /api/v1/jobs                                    agent_routes: live jobs and their ranks
POST     /api/v1/jobs/{job}/captures                     coordination: capture on every rank of a job
POST     /api/v1/jobs/{job}/hang                         coordination: stack snapshot of every rank
GET      /api/v1/captures[/{cid}]                        capture_routes: captures and their state
POST     /api/v1/captures/{cid}/analyze                  capture_routes: (re)run the analysis
GET      /api/v1/captures/{cid}/report                   capture_routes: the analysis (aiprof.report/2)
GET|PUT  /api/v1/captures/{cid}/ranks/{r}/files/{name}   upload_routes: resumable, checksummed upload
POST     /api/v1/hang/{sid}/ranks/{r}                    coordination: one rank's stacks
GET      /api/v1/hang/{sid}                              coordination: a snapshot and its analysis
GET      /                                               pages: captures and jobs (HTML)
GET      /captures/{cid}/...                             pages: the web UI of aiprof ui over that capture
=======  ==============================================  ==================================

Completion of uploads and the analyses (a child process, one at a time) are
server/analysis_queue.py's; shared state is server/context.py's.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Route

from aiprof.server.agent_routes import AgentRoutes
from aiprof.server.analysis_queue import AnalysisQueue
from aiprof.server.auth import TokenAuth
from aiprof.server.capture_routes import CaptureRoutes
from aiprof.server.context import DEFAULT_MAX_FILE_MB, ServiceContext
from aiprof.server.coordination import JobCoordination
from aiprof.server.jsonapi import api_not_found, json_endpoint
from aiprof.server.pages import Pages
from aiprof.server.upload_routes import UploadRoutes

TICK_S = 0.5
FORGET_EVERY_TICKS = 120  # drop agents silent for an hour, once a minute


class Service:
    """The service's parts over one :class:`ServiceContext`, and the ticker that drives them."""

    def __init__(self, data_dir: str, max_file_mb: int = DEFAULT_MAX_FILE_MB, interval_s: float = 1.0,
                 public_url: str | None = None, cluster: str | None = None) -> None:
        self.ctx = ServiceContext(data_dir, max_file_mb, interval_s, public_url)
        self.token = self.ctx.token
        self.stats = self.ctx.stats
        self.pages = Pages(self.ctx)
        self.queue = AnalysisQueue(self.ctx, on_analysed=self.pages.forget, cluster=cluster)
        self.coordination = JobCoordination(self.ctx, self.queue)
        self.agents = AgentRoutes(self.ctx, self.queue)
        self.uploads = UploadRoutes(self.ctx, self.queue)
        self.captures = CaptureRoutes(self.ctx, self.queue)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.queue.start()  # analyses that were running or due are queued again
        self.coordination.start()
        task = asyncio.create_task(self._ticker())
        try:
            yield
        finally:
            task.cancel()

    async def _ticker(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.queue.tick()
                await self.coordination.tick()
                n += 1
                if n % FORGET_EVERY_TICKS == 0:
                    self.ctx.registry.forget_dead()
            except Exception as exc:  # keep ticking; say what went wrong
                print(f"aiprof server: tick: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def routes(self) -> list[Route]:
        """The API and HTML routes (``/captures/<cid>/...`` is dispatched before them, see create_service)."""
        v1 = "/api/v1"
        a, c, u, j = self.agents, self.captures, self.uploads, self.coordination
        table = [  # the agents' calls first: every request is matched against the routes in turn
            (f"{v1}/agents/{{aid}}/heartbeat", a.heartbeat, ["POST"]),
            (f"{v1}/captures/{{cid}}/ranks/{{rank}}/files/{{name}}", u.put_file, ["PUT"]),
            (f"{v1}/captures/{{cid}}/ranks/{{rank}}/files/{{name}}", u.file_status, ["GET"]),
            (f"{v1}/agents/{{aid}}/results", a.result, ["POST"]),
            (f"{v1}/hang/{{sid}}/ranks/{{rank}}", j.hang_upload, ["POST"]),
            (f"{v1}/agents", a.register, ["POST"]),
            (f"{v1}/health", c.health, None),
            (f"{v1}/info", c.info, None),
            (f"{v1}/jobs", a.jobs, None),
            (f"{v1}/jobs/{{job}}/captures", j.trigger_capture, ["POST"]),
            (f"{v1}/jobs/{{job}}/hang", j.trigger_hang, ["POST"]),
            (f"{v1}/captures", c.captures, None),
            (f"{v1}/captures/{{cid}}", c.capture, None),
            (f"{v1}/captures/{{cid}}/analyze", c.analyze, ["POST"]),
            (f"{v1}/captures/{{cid}}/report", c.report, None),
            (f"{v1}/hang/{{sid}}", j.hang_status, None),
            ("/", self.pages.index, None),
        ]
        return [Route(p, json_endpoint(fn), methods=m) for p, fn, m in table] + \
            [Route("/api/{rest:path}", api_not_found)]


def create_service(data_dir: str, max_file_mb: int = DEFAULT_MAX_FILE_MB, interval_s: float = 1.0,
                   public_url: str | None = None, cluster: str | None = None) -> tuple[Any, Service]:
    """The ASGI app of the service (token middleware outermost) and its :class:`Service`;
    ``cluster``: the Ray cluster its analyses run on (docs/scale.md)."""
    svc = Service(data_dir, max_file_mb, interval_s, public_url, cluster)
    app = Starlette(routes=svc.routes(), lifespan=svc.lifespan)

    async def root(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/captures/") or scope.get("path") == "/captures":
            await svc.pages.ui_dispatch(scope, receive, send)
        else:
            await app(scope, receive, send)

    return TokenAuth(root, svc.token), svc
