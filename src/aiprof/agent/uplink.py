"""The agent's link to the central service (``aiprof run/attach --server URL``).

Two daemon threads, both off the training thread:

- ``aiprof-uplink``: registers (host, pid, rank, world size, job id), heartbeats with the
  iteration count, and carries out the commands a heartbeat answers: ``capture`` (a
  :class:`CaptureRequest` for the same capture driver ``aiprof trigger`` uses; ``start_at``
  from the server, or a common wall-clock start for duration captures) and ``stacks`` (all
  threads' Python stacks, for the server's hang analysis).
- ``aiprof-upload``: uploads every capture this process finishes (whether the server, a
  local ``aiprof trigger``, ``aiprof run --iterations`` or the auto-trigger asked for it),
  streamed, SHA-256 checked, resumed, and reports outcomes of the server's commands. Work
  waits in a bounded queue; failed uploads are retried with backoff (up to 60 s apart) while
  the process lives.

Each capture is marked ``.pending-upload`` on disk before its upload is queued (agent/outbox.py),
so one whose upload did not finish while the job lived is sent by the next agent that starts
with the same server and ``--out`` (its own rank's), or by ``aiprof upload``. At start the
upload thread picks up those markers.

If the server is unreachable the job notices nothing: calls time out after a few seconds,
heartbeats back off, and captures stay in the local ``--out`` folder, uploaded when the
server answers again. At interpreter exit, pending uploads get a bounded grace period
(``$AIPROF_UPLOAD_EXIT_WAIT_S``, default 30 s) while the server answers.
"""
from __future__ import annotations

import atexit
import os
import queue
import re
import secrets
import socket
import sys
import threading
import time
from typing import Any

from aiprof.agent import log, outbox
from aiprof.protocol import CaptureRequest

CALL_TIMEOUT_S = 5.0
UPLOAD_TIMEOUT_S = 120.0
MAX_BACKOFF_S = 10.0  # heartbeat retry period at most, while the server is away
MAX_RETRY_S = 60.0
OUTBOX = 64
MAX_RETRIES_KEPT = 32
AUTH_REFUSED = (401, 403)  # a wrong token: retrying cannot help, but `aiprof upload` with the right one can
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _clean(s: str) -> str:
    """A string as a server-safe name (letters, digits, . _ -), at most 128 characters."""
    s = _SAFE.sub("-", s).strip("-.") or "x"
    return s[:128]


def job_identity(env: dict[str, str] | None = None) -> tuple[str, str]:
    """(job id, where it came from): the id every rank of one job shares.

    ``$AIPROF_JOB`` (``aiprof run --job``), torchrun's ``TORCHELASTIC_RUN_ID`` (unless its default
    "none"), SLURM's ``SLURM_JOB_ID`` (+ step), a Kubernetes JobSet/PyTorchJob name, then the
    rendezvous address ``MASTER_ADDR:MASTER_PORT``; a lone process is its own job (host-pid).
    """
    env = os.environ if env is None else env
    if env.get("AIPROF_JOB"):
        return _clean(env["AIPROF_JOB"]), "AIPROF_JOB"
    rid = env.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return _clean("torchrun-" + rid), "TORCHELASTIC_RUN_ID"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return _clean("slurm-" + env["SLURM_JOB_ID"] + (f".{step}" if step else "")), "SLURM_JOB_ID"
    for var in ("JOBSET_NAME", "PYTORCHJOB_NAME", "KUBEFLOW_JOB_NAME"):
        if env.get(var):
            return _clean("k8s-" + env[var]), var
    if env.get("MASTER_PORT"):
        return _clean(f"master-{env.get('MASTER_ADDR', 'localhost')}-{env['MASTER_PORT']}"), "MASTER_ADDR:MASTER_PORT"
    return _clean(f"{socket.gethostname()}-{os.getpid()}"), "process"


class Uplink:
    """Registration, heartbeats, commands and uploads of one agent (see the module doc)."""

    def __init__(self, agent: Any, cfg: dict[str, Any]) -> None:
        from aiprof.server.client import ServerClient

        self.agent = agent
        # its calls (register, heartbeat, upload, result, stacks) may be repeated: each of its
        # threads keeps its connection open between calls (server/client.py)
        self.client = ServerClient(str(cfg["url"]), cfg.get("token"), timeout=CALL_TIMEOUT_S, keep_alive=True)
        self.out = os.path.abspath(cfg.get("out") or "aiprof-captures")
        env = dict(os.environ)
        if cfg.get("job"):
            env["AIPROF_JOB"] = str(cfg["job"])
        self.job, self.job_source = job_identity(env)
        self.host = socket.gethostname()
        self.agent_id = _clean(f"{self.host}-{os.getpid()}-{secrets.token_hex(3)}")
        self.interval = float(cfg.get("interval_s") or 1.0)
        self.registered = False
        self.server_ok: bool | None = None
        self.outbox: queue.Queue = queue.Queue(maxsize=OUTBOX)
        self.retry: list[tuple[float, int, tuple]] = []  # (due monotonic, attempt, task)
        self.pending = 0  # uploads queued or running
        self.uploaded: list[str] = []  # rank dirs uploaded (bounded, for status and tests)
        # capture ids the server asked for (the latest 64, oldest first): their outcome goes back
        self.server_captures: dict[str, None] = {}
        self.heartbeats = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads: list[threading.Thread] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        # every capture from now on, whoever asked (``aiprof run --iterations`` armed one already)
        self.agent.driver.add_listener(self._on_done)
        for name, fn in (("aiprof-uplink", self._run), ("aiprof-upload", self._upload_loop)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self.threads.append(t)
        atexit.register(self._at_exit)

    def stop(self) -> None:
        self._stop.set()

    def _at_exit(self) -> None:
        """Finish the capture in flight, then give pending uploads a bounded grace period."""
        try:
            if os.getpid() != self.agent.pid:
                return
            self.agent.driver.at_exit()
            wait = float(os.environ.get("AIPROF_UPLOAD_EXIT_WAIT_S", "30"))
            deadline = time.monotonic() + wait
            while self.pending > 0 and time.monotonic() < deadline and self.server_ok is not False:
                time.sleep(0.05)
            if self.pending > 0:
                log.warn_once("exit-uploads", f"{self.pending} capture upload(s) not finished at exit; "
                                              f"they stay in {self.out}, marked {outbox.PENDING}: the next run "
                                              f"with this server sends them, or `aiprof upload {self.out}`")
        except Exception as exc:
            log.error("uplink at exit", exc)

    # -- registration + heartbeats --------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        from aiprof.agent.capture import rank_info

        torch = sys.modules.get("torch")
        return {"agent_id": self.agent_id, "job": self.job, "job_source": self.job_source, "host": self.host,
                "pid": os.getpid(), **rank_info(), "origin": getattr(self.agent, "origin", "?"),
                "cmdline": list(getattr(sys, "orig_argv", sys.argv))[:32], "python": sys.version.split()[0],
                "torch": getattr(torch, "__version__", None), **self._beat()}

    def _beat(self) -> dict[str, Any]:
        t = self.agent.tracker
        age = t.seconds_since_boundary()
        return {"steps": t.count, "step_ms": t.median_ms(), "state": self.agent.driver.state,
                "pm_ready": self.agent.driver.pm_ready, "pm_off": self.agent.driver.pm_off,
                "last_step_age_s": None if age is None else round(age, 3), "uploads_pending": self.pending}

    def _run(self) -> None:
        from aiprof.server.client import ServerError

        backoff = self.interval
        while not self._stop.is_set():
            wait = self.interval
            try:
                if getattr(self.agent, "disabled", False):
                    return
                if not self.registered:
                    r = self.client.post("agents", self._identity())
                    self.registered = True
                    self.interval = float(r.get("interval_s") or self.interval)
                    log.info(f"registered with {self.client.base} as {self.agent_id} (job {self.job})")
                r = self.client.post(f"agents/{self.agent_id}/heartbeat", self._beat())
                self.heartbeats += 1
                if self.server_ok is False:
                    log.info(f"server {self.client.base} answers again")
                self.server_ok = True
                backoff = self.interval
                self.interval = float(r.get("interval_s") or self.interval)
                for cmd in r.get("commands") or []:
                    self._command(cmd)
                wait = self.interval
            except ServerError as exc:
                if exc.status == 404:  # a restarted server does not know us: register again now
                    self.registered = False
                    continue
                if exc.status in AUTH_REFUSED:
                    log.warn_once("server-auth", f"server {self.client.base} refuses this agent's token ({exc}); "
                                                 "the job continues and captures stay local")
                else:
                    log.warn_once("server-down", f"server {self.client.base} not answering ({exc}); the job "
                                                 "continues and captures stay local")
                self.server_ok = False  # after the line: the exit wait ends on it, and the line must be out
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                wait = backoff
            except Exception as exc:
                log.error("uplink", exc)
                wait = MAX_BACKOFF_S
            self._stop.wait(wait)

    # -- commands -------------------------------------------------------------------------------
    def _command(self, cmd: dict[str, Any]) -> None:
        op = cmd.get("op")
        if op == "capture":
            req = CaptureRequest.from_dict({**(cmd.get("request") or {}), "out": self.out,
                                            "capture_id": cmd.get("capture_id")})
            self.server_captures[str(req.capture_id)] = None
            while len(self.server_captures) > 64:
                del self.server_captures[next(iter(self.server_captures))]
            start_ns = cmd.get("start_unix_ns")
            if start_ns:  # duration mode: every rank submits at the same wall-clock instant
                delay = max(0.0, (int(start_ns) - time.time_ns()) / 1e9)
                t = threading.Timer(min(delay, 3600.0), self._submit, (req,))
                t.daemon = True
                t.start()
            else:
                self._submit(req)
        elif op == "stacks":
            self._stacks(str(cmd.get("snapshot_id")))
        else:
            log.warn_once(f"op-{op}", f"unknown server command {op!r} (newer server?)")

    def _rank(self) -> int:
        from aiprof.agent.capture import rank_info

        return int(rank_info()["rank"] or 0)

    def _submit(self, req: CaptureRequest) -> None:
        try:
            if req.entry:
                self.agent.set_entry(req.entry)
            err = self.agent.driver.submit(req)  # the listener (_on_done) uploads it
            if err:
                self._put(("result", {"capture_id": req.capture_id, "rank": self._rank(), "ok": False,
                                      "error": err, "phase": "submit"}))
        except Exception as exc:
            log.error("server capture request", exc)

    def _on_done(self, result: dict) -> None:
        """Capture driver listener (export thread), for every capture: mark it pending on disk,
        queue its upload, and the outcome of a capture the server asked for."""
        d = result.get("dir")
        m = re.search(r"rank(\d+)$", d or "")
        rank = int(m.group(1)) if m else self._rank()
        cid = os.path.basename(os.path.dirname(d)) if d else (self.agent.driver.req.capture_id
                                                              if self.agent.driver.req else "?")
        if cid in self.server_captures:  # the server knows no other capture id (404 otherwise)
            self._put(("result", {"capture_id": cid, "rank": rank, "ok": bool(result.get("ok")),
                                  "error": result.get("error"), "steps": result.get("steps"), "phase": "captured",
                                  "host": self.host, "pid": os.getpid()}))
        if result.get("ok") and d:
            try:
                outbox.mark_pending(d, self.client.base, cid, rank, self.job)
            except OSError as exc:
                log.warn_once("outbox-mark", f"cannot mark {d} for upload ({exc}); uploading it now only")
            self._queue_upload(outbox.RankDir(d, cid, rank, self.job, self.client.base))

    def _queue_upload(self, rd: outbox.RankDir) -> bool:
        with self._lock:
            self.pending += 1
        if self._put(("upload", rd)):
            return True
        with self._lock:
            self.pending -= 1
        return False

    def _resume_outbox(self) -> None:
        """Queue this rank's captures that an earlier process left marked pending for this server."""
        try:
            left = outbox.pending(self.out, self.client.base, self._rank())
            queued = sum(self._queue_upload(rd) for rd in left[:OUTBOX // 2])
            if left:
                log.info(f"{len(left)} capture(s) left pending by an earlier run; {queued} queued for upload")
        except Exception as exc:
            log.error("uplink outbox scan", exc)

    def _put(self, task: tuple) -> bool:
        try:
            self.outbox.put_nowait(task)
            return True
        except queue.Full:
            log.warn_once("outbox-full", f"upload queue full: a capture stays in {self.out}, marked "
                                         f"{outbox.PENDING} for the next run or `aiprof upload`")
            return False

    def _stacks(self, sid: str) -> None:
        from aiprof.agent.autotrigger import thread_stacks
        from aiprof.agent.collectives import snapshot as collectives_snapshot
        from aiprof.server.client import ServerError

        dump = {"pid": os.getpid(), "host": self.host, "ok": True, "error": None, "native": False,
                "threads": thread_stacks(), "last_collectives": collectives_snapshot(), "steps": self.agent.tracker.count,
                "last_step_age_s": self.agent.tracker.seconds_since_boundary()}
        try:
            self.client.post(f"hang/{sid}/ranks/{self._rank()}", dump, timeout=15.0)
        except ServerError as exc:
            log.warn_once(f"stacks-{sid}", f"stack snapshot not sent: {exc}")

    # -- uploads --------------------------------------------------------------------------------
    def _upload_loop(self) -> None:
        self._resume_outbox()  # here, not in start(): scanning --out must not delay the job
        while not self._stop.is_set():
            try:
                task = self._next_task()
                if task is None:
                    continue
                attempt, t = task
                self._do(t, attempt)
            except Exception as exc:
                log.error("uplink upload", exc)
                time.sleep(1.0)

    def _next_task(self) -> tuple[int, tuple] | None:
        now = time.monotonic()
        with self._lock:
            due = [x for x in self.retry if x[0] <= now]
            if due and self.server_ok is not False:
                self.retry.remove(due[0])
                return due[0][1], due[0][2]
        try:
            return 0, self.outbox.get(timeout=0.5)
        except queue.Empty:
            return None

    def _do(self, task: tuple, attempt: int) -> None:
        from aiprof.server.client import ServerError

        try:
            if task[0] == "result":
                self.client.post(f"agents/{self.agent_id}/results", task[1])
            elif task[0] == "upload":
                rd = task[1]
                outbox.upload_rank_dir(self.client, rd, UPLOAD_TIMEOUT_S)
                with self._lock:
                    self.pending -= 1
                    self.uploaded = (self.uploaded + [rd.path])[-32:]
        except ServerError as exc:
            if exc.status in AUTH_REFUSED:  # a token problem, not the capture's: it stays pending
                log.warn_once("upload-auth", f"server refused this agent's token ({exc}); captures stay in "
                                             f"{self.out}, marked {outbox.PENDING}: `aiprof upload {self.out}` "
                                             "with the right token sends them")
                if task[0] == "upload":
                    with self._lock:
                        self.pending -= 1
                return
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in (404, 408, 409, 429):
                log.warn_once(f"upload-refused-{exc.status}", f"server refused: {exc}; the capture stays local")
                if task[0] == "upload":
                    try:
                        outbox.mark_refused(task[1].path, self.client.base, str(exc))
                    except OSError:
                        pass
                    with self._lock:
                        self.pending -= 1
                return
            with self._lock:
                if len(self.retry) < MAX_RETRIES_KEPT:
                    delay = min(MAX_RETRY_S, 1.0 * 2 ** attempt)
                    self.retry.append((time.monotonic() + delay, attempt + 1, task))
                elif task[0] == "upload":
                    self.pending -= 1
            log.warn_once("upload-retry", f"upload to {self.client.base} failed ({exc}); will retry")


def start_uplink(agent: Any, cfg: dict[str, Any] | None) -> Uplink | None:
    """Start the agent's uplink when ``cfg`` names a server (once per agent); never raises."""
    try:
        if not cfg or not cfg.get("url"):
            return None
        existing = getattr(agent, "uplink", None)
        if existing is not None:
            return existing
        up = Uplink(agent, cfg)
        up.start()
        agent.uplink = up
        return up
    except Exception as exc:
        log.error("server uplink start", exc)
        return None
