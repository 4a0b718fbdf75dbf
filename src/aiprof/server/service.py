"""The central service (``aiprof server``): agent registry, job-wide triggers, uploads, analysis, UI.

One Starlette app on uvicorn, state on disk in DATA (server/store.py). Routes (all under the
token, server/auth.py; JSON in and out; documented in docs/server.md):

=======  ==============================================  ===========================================
POST     /api/v1/agents                                  register (idempotent; the agent picks its id)
POST     /api/v1/agents/{id}/heartbeat                   iteration count; answers pending commands
POST     /api/v1/agents/{id}/results                     an agent's outcome of a command
GET      /api/v1/jobs                                    live jobs and their ranks
POST     /api/v1/jobs/{job}/captures                     trigger a capture on every rank of a job
POST     /api/v1/jobs/{job}/hang                         stack snapshot of every rank -> hang analysis
GET      /api/v1/captures[/{cid}]                        captures and their state
POST     /api/v1/captures/{cid}/analyze                  (re)run the analysis
GET      /api/v1/captures/{cid}/report                   the analysis (schema aiprof.report/1)
GET|PUT  /api/v1/captures/{cid}/ranks/{r}/files/{name}   resumable, checksummed upload
POST     /api/v1/hang/{sid}/ranks/{r}                    one rank's stacks
GET      /api/v1/hang/{sid}                              a snapshot's state and analysis
GET      /                                               captures and jobs (HTML)
GET      /captures/{cid}/...                             the web UI of aiprof ui over that capture
=======  ==============================================  ===========================================

Analysis runs ``aiprof analyze`` in a child process (one at a time): the event loop never
holds the GIL for seconds, and a crash in analysis cannot take the server down.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import html
import json
import os
import re
import sys
import time
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from aiprof import __version__
from aiprof.agent.config import CaptureRequest, RequestError
from aiprof.server.auth import TokenAuth, load_or_create_token
from aiprof.server.client import file_sha256
from aiprof.server.registry import Registry, new_id, plan_start, plan_start_time
from aiprof.server.store import STATE, BadName, DataDir, read_json, safe_name, safe_rank, write_json

MAX_JSON = 1 << 20  # request bodies other than uploads
MAX_STACKS_JSON = 8 << 20
DEFAULT_MAX_FILE_MB = 4096
MAX_FILES_PER_RANK = 16
UI_APPS_KEPT = 8  # per-capture UI apps held in memory (each holds its capture's tables once opened)
ANALYSIS_TIMEOUT_S = 1800
TICK_S = 0.5
SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.extra = status, extra


def _json_error(exc: Exception) -> JSONResponse:
    if isinstance(exc, HTTPError):
        return JSONResponse({"error": str(exc), **exc.extra}, status_code=exc.status)
    if isinstance(exc, (BadName, RequestError)):
        return JSONResponse({"error": str(exc)}, status_code=400)
    raise exc


async def _read_json(req: Request, limit: int = MAX_JSON) -> dict:
    """The request's JSON object, read with a size bound (413 beyond it)."""
    buf = bytearray()
    async for chunk in req.stream():
        buf += chunk
        if len(buf) > limit:
            raise HTTPError(413, f"request body over {limit} bytes")
    if not buf:
        return {}
    try:
        obj = json.loads(buf)
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "body must be a JSON object")
    return obj


class Service:
    """Everything the routes share: the data folder, the registry, the analysis queue, UI apps."""

    def __init__(self, data_dir: str, max_file_mb: int = DEFAULT_MAX_FILE_MB, interval_s: float = 1.0,
                 public_url: str | None = None) -> None:
        self.data = DataDir(data_dir)
        self.token = load_or_create_token(self.data.root)
        self.registry = Registry(interval_s)
        self.max_file = max_file_mb << 20
        self.public_url = public_url
        self.file_locks: dict[tuple, asyncio.Lock] = {}
        self.ui_apps: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.analysing: set[str] = set()
        # captures still waiting for ranks and snapshots still collecting: the ticker looks at
        # these only, not at every capture ever stored
        self.active: set[str] = set()
        self.active_hang: set[str] = set()
        self.analysis_sem: asyncio.Semaphore | None = None
        self.stats = {"uploads": 0, "upload_bytes": 0, "checksum_mismatch": 0}

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.analysis_sem = asyncio.Semaphore(1)
        self._recover()
        task = asyncio.create_task(self._ticker())
        try:
            yield
        finally:
            task.cancel()

    def _recover(self) -> None:
        """After a restart: analyses that were running or due are queued again."""
        for cid in self.data.capture_ids():
            st = self.data.load_capture(cid) or {}
            if st.get("state") == "capturing":
                self.active.add(cid)
            if st.get("state") == "analysing" or (st.get("state") == "uploaded" and st.get("auto_analyze")):
                self._start_analysis(cid)
        for sid in self.data.hang_ids():
            path = os.path.join(self.data.hang_dir(sid), STATE)
            hs = read_json(path) or {}
            if hs.get("state") in ("collecting", "analysing"):  # interrupted: analyse what arrived
                write_json(path, {**hs, "state": "collecting"})
                self.active_hang.add(sid)

    async def _ticker(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(TICK_S)
            try:
                for cid in sorted(self.active):
                    self._check_complete(cid)
                for sid in sorted(self.active_hang):
                    await self._check_hang(sid)
                n += 1
                if n % 120 == 0:
                    self.registry.forget_dead()
            except Exception as exc:  # keep ticking; say what went wrong
                print(f"aiprof server: tick: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def url(self, req: Request | None, path: str) -> str:
        if self.public_url:
            return self.public_url.rstrip("/") + path
        if req is not None:
            return str(req.base_url).rstrip("/") + path
        return path

    # ------------------------------------------------------------------ agents
    async def register(self, req: Request) -> Response:
        body = await _read_json(req)
        aid = safe_name(str(body.get("agent_id", "")), "agent id")
        job = safe_name(str(body.get("job", "")), "job")
        a = self.registry.register(aid, job, body)
        return JSONResponse({"agent_id": a.agent_id, "job": a.job, "interval_s": self.registry.interval})

    async def heartbeat(self, req: Request) -> Response:
        aid = safe_name(req.path_params["aid"], "agent id")
        body = await _read_json(req)
        got = self.registry.heartbeat(aid, body)
        if got is None:
            raise HTTPError(404, "unknown agent: register again")
        _, cmds = got
        return JSONResponse({"commands": cmds, "interval_s": self.registry.interval})

    async def result(self, req: Request) -> Response:
        body = await _read_json(req)
        cid = safe_name(str(body.get("capture_id", "")), "capture id")
        rank = safe_rank(body.get("rank"))
        rec = {k: body.get(k) for k in ("ok", "error", "steps", "phase", "dir", "host", "pid")}
        rec["at"] = time.time()

        def upd(st: dict) -> None:
            st.setdefault("results", {})[str(rank)] = rec
        if self.data.update_capture(cid, upd) is None:
            raise HTTPError(404, f"no capture {cid}")
        self._check_complete(cid)
        return JSONResponse({"ok": True})

    async def jobs(self, req: Request) -> Response:
        now = time.time()
        out = {job: [a.public(now, self.registry.interval) for a in agents]
               for job, agents in self.registry.jobs(alive_only=req.query_params.get("all") != "1").items()}
        return JSONResponse({"jobs": out, "interval_s": self.registry.interval})

    def _job_agents(self, job: str) -> list:
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

    # ------------------------------------------------------------------ triggers
    async def trigger_capture(self, req: Request) -> Response:
        body = await _read_json(req)
        agents = self._job_agents(req.path_params["job"])
        raw = dict(body.get("request") or {})
        cid = safe_name(str(raw.get("capture_id") or new_id()), "capture id")
        if os.path.exists(self.data.capture_dir(cid)):
            raise HTTPError(409, f"capture {cid} exists")
        raw["capture_id"] = cid
        raw["out"] = "server"  # the agent writes to its own --out; this one is never used
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
                 "results": {}, "state": "capturing", "source": "trigger"}
        os.makedirs(self.data.capture_dir(cid), exist_ok=True)
        self.data.save_capture(cid, state)
        self.active.add(cid)
        self.registry.send(agents, {"op": "capture", "capture_id": cid, "request": r.to_dict(),
                                    "start_unix_ns": start_ns})
        return JSONResponse({"capture_id": cid, "job": state["job"], "ranks": state["expected"], "start_at": start_at,
                             "start_unix_ns": start_ns, "url": self.url(req, f"/captures/{cid}/"),
                             "status": self.url(req, f"/api/v1/captures/{cid}")})

    async def trigger_hang(self, req: Request) -> Response:
        body = await _read_json(req)
        agents = self._job_agents(req.path_params["job"])
        sid = new_id("hang-")
        timeout = max(2.0, min(float(body.get("timeout_s") or 15.0), 300.0))
        st = {"snapshot_id": sid, "job": agents[0].job, "created": time.time(), "deadline": time.time() + timeout,
              "expected": sorted(a.rank for a in agents), "state": "collecting"}
        write_json(os.path.join(self.data.hang_dir(sid), STATE), st)
        self.active_hang.add(sid)
        self.registry.send(agents, {"op": "stacks", "snapshot_id": sid})
        return JSONResponse({"snapshot_id": sid, "ranks": st["expected"], "status": self.url(req, f"/api/v1/hang/{sid}")})

    async def hang_upload(self, req: Request) -> Response:
        sid = safe_name(req.path_params["sid"], "snapshot id")
        rank = safe_rank(req.path_params["rank"])
        d = self.data.hang_dir(sid)
        st = read_json(os.path.join(d, STATE))
        if st is None:
            raise HTTPError(404, f"no snapshot {sid}")
        body = await _read_json(req, MAX_STACKS_JSON)
        body["rank"] = rank
        write_json(os.path.join(d, f"rank{rank}.json"), body)
        await self._check_hang(sid)
        return JSONResponse({"ok": True})

    async def _check_hang(self, sid: str) -> None:
        d = self.data.hang_dir(sid)
        st = read_json(os.path.join(d, STATE))
        if not st or st.get("state") != "collecting":
            self.active_hang.discard(sid)
            return
        have = {int(m.group(1)) for f in os.listdir(d) if (m := re.fullmatch(r"rank(\d+)\.json", f))}
        if not set(st["expected"]) <= have and time.time() < st["deadline"]:
            return
        st["state"] = "analysing"
        write_json(os.path.join(d, STATE), st)
        self.active_hang.discard(sid)
        procs = [read_json(os.path.join(d, f"rank{r}.json")) for r in sorted(have)]

        def analyse() -> dict:
            from aiprof.analysis.hang import analyse as hang_analyse, format_text

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

    # ------------------------------------------------------------------ uploads
    def _file_status(self, cid: str, rank: int, name: str) -> dict:
        final = self.data.file_path(cid, rank, name)
        if os.path.isfile(final):
            sha = read_json(self.data.part_path(cid, rank, name)[:-len(".part")] + ".sha256.json") or {}
            return {"complete": True, "received": os.path.getsize(final), "sha256": sha.get("sha256")}
        part = self.data.part_path(cid, rank, name)
        return {"complete": False, "received": os.path.getsize(part) if os.path.isfile(part) else 0}

    async def file_status(self, req: Request) -> Response:
        p = req.path_params
        return JSONResponse(self._file_status(p["cid"], safe_rank(p["rank"]), p["name"]))

    async def put_file(self, req: Request) -> Response:
        p, q = req.path_params, req.query_params
        cid = safe_name(p["cid"], "capture id")
        rank = safe_rank(p["rank"])
        name = safe_name(p["name"], "file name")
        try:
            offset, size = int(q.get("offset", "0")), int(q["size"])
        except (KeyError, ValueError):
            raise HTTPError(400, "offset and size must be integers") from None
        sha = q.get("sha256", "").lower()
        if not SHA_RE.match(sha):
            raise HTTPError(400, "sha256 must be 64 hex digits")
        if size < 0 or size > self.max_file:
            raise HTTPError(413, f"file of {size} bytes is over the limit of {self.max_file} bytes")
        key = (cid, rank, name)
        lock = self.file_locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._receive(req, cid, rank, name, offset, size, sha)
        finally:
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self.file_locks.pop(key, None)

    async def _receive(self, req: Request, cid: str, rank: int, name: str, offset: int, size: int, sha: str) -> Response:
        st = self._file_status(cid, rank, name)
        if st["complete"]:
            if st.get("sha256") == sha:
                return JSONResponse(st)
            raise HTTPError(409, f"{name} of rank {rank} is already complete with another checksum")
        if offset != st["received"]:
            raise HTTPError(409, f"offset {offset} does not match the {st['received']} bytes held", received=st["received"])
        self._ensure_capture(cid, req.query_params.get("job"))
        rdir = self.data.rank_dir(cid, rank)
        if not os.path.isdir(rdir) or name not in os.listdir(rdir):
            existing = [f for f in (os.listdir(rdir) if os.path.isdir(rdir) else []) if not f.startswith(".")]
            if len(existing) >= MAX_FILES_PER_RANK:
                raise HTTPError(413, f"rank {rank} already has {len(existing)} files")
        part = self.data.part_path(cid, rank, name)
        os.makedirs(os.path.dirname(part), exist_ok=True)
        received = offset
        over = False
        f = open(part, "ab")
        try:
            async for chunk in req.stream():
                if received + len(chunk) > size:
                    over = True
                    break
                f.write(chunk)
                received += len(chunk)
        except ClientDisconnect:  # keep what arrived: the client resumes from it
            return JSONResponse({"complete": False, "received": received})
        finally:
            f.close()
        if over:
            os.unlink(part)
            raise HTTPError(413, f"more bytes than the declared size {size}")
        if received < size:
            return JSONResponse({"complete": False, "received": received})
        digest, n = await anyio.to_thread.run_sync(file_sha256, part)
        if digest != sha or n != size:
            os.unlink(part)
            self.stats["checksum_mismatch"] += 1
            raise HTTPError(422, f"checksum mismatch for {name}: got {digest}, expected {sha}; send it again")
        write_json(part[:-len(".part")] + ".sha256.json", {"sha256": digest, "size": n})
        os.replace(part, self.data.file_path(cid, rank, name))
        self.stats["uploads"] += 1
        self.stats["upload_bytes"] += n
        if name == "meta.json":
            self._check_complete(cid)
        return JSONResponse({"complete": True, "received": n, "sha256": digest})

    def _ensure_capture(self, cid: str, job: str | None) -> None:
        """An upload for a capture the server did not trigger (``aiprof run --server --iterations``)."""
        with self.data.lock:
            if self.data.load_capture(cid) is None:
                os.makedirs(self.data.capture_dir(cid), exist_ok=True)
                self.data.save_capture(cid, {"capture_id": cid, "job": safe_name(job, "job") if job else None,
                                             "created": time.time(), "expected": None, "results": {},
                                             "deadline": time.time() + 600, "auto_analyze": True,
                                             "state": "capturing", "source": "agent"})
                self.active.add(cid)

    # ------------------------------------------------------------------ completion + analysis
    def _check_complete(self, cid: str) -> None:
        """capturing -> uploaded when every expected rank has its files or reported a failure
        (or at the deadline, with what arrived); then the analysis starts if asked for."""
        st = self.data.load_capture(cid)
        if not st or st.get("state") != "capturing":
            self.active.discard(cid)
            return
        ranks = self.data.uploaded_ranks(cid)
        done = {r for r, files in ranks.items() if "meta.json" in files}
        failed = {int(r) for r, res in (st.get("results") or {}).items() if res.get("ok") is False}
        expected = st.get("expected")
        if expected is None:  # implicit capture: the world size in the ranks' meta.json
            worlds = {int((read_json(os.path.join(self.data.rank_dir(cid, r), "meta.json")) or {}).get("world_size") or 1)
                      for r in done}
            expected = list(range(max(worlds))) if worlds else None
        complete = expected is not None and set(expected) <= done | failed
        if not complete and time.time() < st.get("deadline", 0):
            return

        def upd(s: dict) -> None:
            if s.get("state") != "capturing":
                return
            s["received"] = sorted(done)
            s["missing"] = sorted(set(expected or []) - done)
            s["state"] = "uploaded" if done else "failed"
            if not done:
                s["error"] = "no rank's capture arrived before the deadline"
            s["steps_by_rank"] = {str(r): ((read_json(os.path.join(self.data.rank_dir(cid, r), "meta.json")) or {})
                                           .get("steps") or {}).get("captured") for r in sorted(done)}
            steps = [tuple(v or ()) for v in s["steps_by_rank"].values()]
            s["aligned"] = bool(steps) and all(x == steps[0] for x in steps)
        st = self.data.update_capture(cid, upd)
        self.active.discard(cid)
        if st and st.get("state") == "uploaded" and st.get("auto_analyze"):
            self._start_analysis(cid)

    def _start_analysis(self, cid: str) -> bool:
        if cid in self.analysing:
            return False
        self.analysing.add(cid)
        self.data.update_capture(cid, lambda s: s.update(state="analysing", analysis={"queued": time.time()}))
        asyncio.get_running_loop().create_task(self._analyse(cid))
        return True

    async def _analyse(self, cid: str) -> None:
        assert self.analysis_sem is not None
        try:
            async with self.analysis_sem:
                files = self.data.trace_files(cid)
                out = os.path.join(self.data.capture_dir(cid), "report")
                os.makedirs(out, exist_ok=True)
                t0 = time.time()
                err = None
                if not files:
                    err = "no complete rank to analyse"
                else:
                    with open(os.path.join(out, "analyze.log"), "wb") as log:
                        proc = await asyncio.create_subprocess_exec(
                            sys.executable, "-m", "aiprof", "analyze", *files, "--out", out,
                            stdout=log, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
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
                               "findings": [{"code": f.get("code"), "severity": f.get("severity"), "title": f.get("title")}
                                            for f in (rep.get("findings") or [])[:20]]}

                def upd(s: dict) -> None:
                    s["state"] = "analysed" if err is None else "failed"
                    s["analysis"] = {"started": t0, "finished": time.time(), "error": err, "summary": summary}
                    if err:
                        s["error"] = err
                self.data.update_capture(cid, upd)
                self.ui_apps.pop(cid, None)  # the next UI visit opens the fresh report
        finally:
            self.analysing.discard(cid)

    async def captures(self, req: Request) -> Response:
        out = []
        for cid in self.data.capture_ids()[:500]:
            st = self.data.load_capture(cid) or {}
            out.append({k: st.get(k) for k in ("capture_id", "job", "created", "state", "expected", "received",
                                                "missing", "aligned", "source")} | {"url": self.url(req, f"/captures/{cid}/")})
        return JSONResponse({"captures": out})

    async def capture(self, req: Request) -> Response:
        cid = safe_name(req.path_params["cid"], "capture id")
        st = self.data.load_capture(cid)
        if st is None:
            raise HTTPError(404, f"no capture {cid}")
        st["files"] = {str(r): f for r, f in self.data.uploaded_ranks(cid).items()}
        st["url"] = self.url(req, f"/captures/{cid}/")
        return JSONResponse(st)

    async def analyze(self, req: Request) -> Response:
        cid = safe_name(req.path_params["cid"], "capture id")
        st = self.data.load_capture(cid)
        if st is None:
            raise HTTPError(404, f"no capture {cid}")
        if st.get("state") == "capturing":
            self.data.update_capture(cid, lambda s: s.update(state="uploaded", received=sorted(self.data.uploaded_ranks(cid))))
        started = self._start_analysis(cid)
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
        return JSONResponse({"version": __version__, "data": self.data.root, "stats": self.stats,
                             "agents": len(self.registry.agents), "interval_s": self.registry.interval})

    # ------------------------------------------------------------------ web UI
    async def index(self, req: Request) -> Response:
        rows = []
        for cid in self.data.capture_ids()[:200]:
            st = self.data.load_capture(cid) or {}
            ranks = ", ".join(map(str, st.get("received") or st.get("expected") or []))
            rows.append(f"<tr><td><a href='captures/{html.escape(cid)}/'>{html.escape(cid)}</a></td>"
                        f"<td>{html.escape(str(st.get('job')))}</td><td>{html.escape(str(st.get('state')))}</td>"
                        f"<td>{html.escape(ranks)}</td><td>{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.get('created', 0)))}</td></tr>")
        jobs = []
        now = time.time()
        for job, agents in self.registry.jobs().items():
            jobs.append(f"<tr><td>{html.escape(job)}</td><td>{len(agents)}</td><td>"
                        + html.escape(", ".join(f"{a.rank}@{a.host}:{a.pid} ({a.steps} it)" for a in agents[:32]))
                        + f"</td><td>{max(now - a.last_seen for a in agents):.1f} s</td></tr>")
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>aiprof server</title><link rel='icon' href='data:,'>"
                "<style>body{font:14px system-ui;margin:2em}td,th{padding:.2em .8em;text-align:left}</style></head>"
                f"<body><h1>aiprof server</h1><h2>Captures</h2><table id='captures'><tr><th>capture</th><th>job</th>"
                f"<th>state</th><th>ranks</th><th>created</th></tr>{''.join(rows)}</table>"
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
            await _json_error(exc)(scope, receive, send)
            return
        if not m or m.group(2) is None:
            await RedirectResponse(f"/captures/{cid}/", status_code=307)(scope, receive, send)
            return
        try:
            app = await self._ui_app(cid)
        except HTTPError as exc:
            await _json_error(exc)(scope, receive, send)
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


def create_service(data_dir: str, max_file_mb: int = DEFAULT_MAX_FILE_MB, interval_s: float = 1.0,
                   public_url: str | None = None) -> tuple[Any, Service]:
    """The ASGI app of the service (token middleware outermost) and its :class:`Service`."""
    svc = Service(data_dir, max_file_mb, interval_s, public_url)

    def wrap(fn: Any) -> Any:
        async def endpoint(req: Request) -> Response:
            try:
                return await fn(req)
            except (HTTPError, BadName, RequestError) as exc:
                return _json_error(exc)
        return endpoint

    v1 = "/api/v1"
    routes = [
        Route(f"{v1}/health", wrap(svc.health)),
        Route(f"{v1}/info", wrap(svc.info)),
        Route(f"{v1}/agents", wrap(svc.register), methods=["POST"]),
        Route(f"{v1}/agents/{{aid}}/heartbeat", wrap(svc.heartbeat), methods=["POST"]),
        Route(f"{v1}/agents/{{aid}}/results", wrap(svc.result), methods=["POST"]),
        Route(f"{v1}/jobs", wrap(svc.jobs)),
        Route(f"{v1}/jobs/{{job}}/captures", wrap(svc.trigger_capture), methods=["POST"]),
        Route(f"{v1}/jobs/{{job}}/hang", wrap(svc.trigger_hang), methods=["POST"]),
        Route(f"{v1}/captures", wrap(svc.captures)),
        Route(f"{v1}/captures/{{cid}}", wrap(svc.capture)),
        Route(f"{v1}/captures/{{cid}}/analyze", wrap(svc.analyze), methods=["POST"]),
        Route(f"{v1}/captures/{{cid}}/report", wrap(svc.report)),
        Route(f"{v1}/captures/{{cid}}/ranks/{{rank}}/files/{{name}}", wrap(svc.file_status), methods=["GET"]),
        Route(f"{v1}/captures/{{cid}}/ranks/{{rank}}/files/{{name}}", wrap(svc.put_file), methods=["PUT"]),
        Route(f"{v1}/hang/{{sid}}", wrap(svc.hang_status)),
        Route(f"{v1}/hang/{{sid}}/ranks/{{rank}}", wrap(svc.hang_upload), methods=["POST"]),
        Route("/", wrap(svc.index)),
        Route("/api/{rest:path}", lambda q: JSONResponse({"error": "no such endpoint"}, status_code=404)),
    ]
    app = Starlette(routes=routes, lifespan=svc.lifespan)

    async def root(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/captures/") or scope.get("path") == "/captures":
            await svc.ui_dispatch(scope, receive, send)
        else:
            await app(scope, receive, send)

    return TokenAuth(root, svc.token), svc
