"""Routes over stored captures: list, state, (re)analysis, report; health and server info."""
from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiprof import __version__
from aiprof.server.analysis_queue import PROGRESS_FILE, AnalysisQueue
from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import HTTPError
from aiprof.server.store import read_json, safe_name

CAPTURES_LISTED = 500
LIST_FIELDS = ("capture_id", "job", "created", "state", "expected", "received", "missing", "aligned", "source",
               "trigger")


class CaptureRoutes:
    """``/captures[/{cid}]``, ``/captures/{cid}/analyze``, ``/captures/{cid}/report``, ``/health``, ``/info``."""

    def __init__(self, ctx: ServiceContext, queue: AnalysisQueue) -> None:
        self.ctx = ctx
        self.data = ctx.data
        self.queue = queue

    async def captures(self, req: Request) -> Response:
        out = []
        for cid in self.data.capture_ids()[:CAPTURES_LISTED]:
            st = self.data.load_capture(cid) or {}
            out.append({k: st.get(k) for k in LIST_FIELDS} | {"url": self.ctx.url(req, f"/captures/{cid}/")})
        return JSONResponse({"captures": out})

    async def capture(self, req: Request) -> Response:
        cid = safe_name(req.path_params["cid"], "capture id")
        st = self.data.load_capture(cid)
        if st is None:
            raise HTTPError(404, f"no capture {cid}")
        st["files"] = {str(r): f for r, f in self.data.uploaded_ranks(cid).items()}
        st["url"] = self.ctx.url(req, f"/captures/{cid}/")
        if st.get("state") == "analysing":  # how far the analysis is: phase, done, total (docs/scale.md)
            progress = read_json(os.path.join(self.data.capture_dir(cid), "report", PROGRESS_FILE))
            if progress:
                st.setdefault("analysis", {})["progress"] = progress
        return JSONResponse(st)

    async def analyze(self, req: Request) -> Response:
        cid = safe_name(req.path_params["cid"], "capture id")
        st = self.data.load_capture(cid)
        if st is None:
            raise HTTPError(404, f"no capture {cid}")
        if st.get("state") == "capturing":
            self.data.update_capture(cid, lambda s: s.update(state="uploaded", received=sorted(self.data.uploaded_ranks(cid))))
        started = self.queue.start_analysis(cid)
        return JSONResponse({"capture_id": cid, "started": started})

    async def report(self, req: Request) -> Response:
        cid = safe_name(req.path_params["cid"], "capture id")
        path = os.path.join(self.data.capture_dir(cid), "report", "report.json")
        if not os.path.isfile(path):
            raise HTTPError(404, f"capture {cid} has no report yet")
        with open(path, "rb") as f:
            return Response(f.read(), media_type="application/json")

    async def health(self, req: Request) -> Response:
        return JSONResponse({"ok": True})

    async def info(self, req: Request) -> Response:
        return JSONResponse({"version": __version__, "data": self.data.root, "stats": self.ctx.stats,
                             "agents": len(self.ctx.registry.agents), "interval_s": self.ctx.registry.interval})
