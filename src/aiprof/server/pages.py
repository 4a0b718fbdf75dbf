"""HTML of the service: the list of captures and live jobs at ``/``, and each capture's
``aiprof ui`` app under ``/captures/<cid>/`` (built on first visit, a few kept in memory)."""
from __future__ import annotations

import collections
import html
import os
import re
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from aiprof.server.context import ServiceContext
from aiprof.server.jsonapi import HTTPError, json_error
from aiprof.server.store import BadName, read_json, safe_name

UI_APPS_KEPT = 8  # per-capture UI apps held in memory (each holds its capture's tables once opened)
CAPTURES_SHOWN = 200


class Pages:
    """``GET /`` and ``/captures/<cid>/...``."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.data = ctx.data
        self.ui_apps: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def forget(self, cid: str) -> None:
        """Drop the UI app of ``cid`` (its report changed): the next visit builds a fresh one."""
        self.ui_apps.pop(cid, None)

    async def index(self, req: Request) -> Response:
        rows = []
        for cid in self.data.capture_ids()[:CAPTURES_SHOWN]:
            st = self.data.load_capture(cid) or {}
            ranks = ", ".join(map(str, st.get("received") or st.get("expected") or []))
            why = str((st.get("trigger") or {}).get("reason") or "")
            rows.append(f"<tr><td><a href='captures/{html.escape(cid)}/'>{html.escape(cid)}</a></td>"
                        f"<td>{html.escape(str(st.get('job')))}</td><td>{html.escape(str(st.get('state')))}</td>"
                        f"<td>{html.escape(why)}</td>"
                        f"<td>{html.escape(ranks)}</td><td>{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.get('created', 0)))}</td></tr>")
        jobs = []
        now = time.time()
        for job, agents in self.ctx.registry.jobs().items():
            jobs.append(f"<tr><td>{html.escape(job)}</td><td>{len(agents)}</td><td>"
                        + html.escape(", ".join(f"{a.rank}@{a.host}:{a.pid} ({a.steps} it)" for a in agents[:32]))
                        + f"</td><td>{max(now - a.last_seen for a in agents):.1f} s</td></tr>")
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>aiprof server</title><link rel='icon' href='data:,'>"
                "<style>body{font:14px system-ui;margin:2em}td,th{padding:.2em .8em;text-align:left}</style></head>"
                f"<body><h1>aiprof server</h1><h2>Captures</h2><table id='captures'><tr><th>capture</th><th>job</th>"
                f"<th>state</th><th>trigger</th><th>ranks</th><th>created</th></tr>{''.join(rows)}</table>"
                f"<h2>Live jobs</h2><table id='jobs'><tr><th>job</th><th>agents</th><th>ranks</th><th>oldest heartbeat</th>"
                f"</tr>{''.join(jobs)}</table></body></html>")
        return HTMLResponse(page)

    async def ui_dispatch(self, scope: dict, receive: Any, send: Any) -> None:
        """``/captures/<cid>/...`` -> that capture's ``aiprof ui`` app (relative URLs, so it works under a prefix)."""
        path = scope["path"]
        m = re.match(r"^/captures/([^/]+)(/.*)?$", path)
        try:
            cid = safe_name(m.group(1) if m else "", "capture id")
        except BadName as exc:
            await json_error(exc)(scope, receive, send)
            return
        if not m or m.group(2) is None:
            await RedirectResponse(f"/captures/{cid}/", status_code=307)(scope, receive, send)
            return
        try:
            app = await self._ui_app(cid)
        except HTTPError as exc:
            await json_error(exc)(scope, receive, send)
            return
        child = dict(scope, root_path=scope.get("root_path", "") + f"/captures/{cid}")
        await app(child, receive, send)

    async def _ui_app(self, cid: str) -> Any:
        if cid in self.ui_apps:
            self.ui_apps.move_to_end(cid)
            return self.ui_apps[cid]
        st = self.data.load_capture(cid)
        if st is None:
            raise HTTPError(404, f"no capture {cid}")
        files = self.data.trace_files(cid)
        if not files:
            raise HTTPError(409, f"capture {cid} has no complete rank yet (state {st.get('state')})")
        report = read_json(os.path.join(self.data.capture_dir(cid), "report", "report.json"))

        def build() -> Any:
            from aiprof.server.app import create_app
            from aiprof.server.data import CaptureData
            from aiprof.trace.store import open_capture

            return create_app(CaptureData(open_capture(files, show_progress=False), report=report))

        app = await anyio.to_thread.run_sync(build)
        self.ui_apps[cid] = app
        while len(self.ui_apps) > UI_APPS_KEPT:
            self.ui_apps.popitem(last=False)
        return app
