"""Driving the service from a client: job-wide capture and hang snapshot, waiting for results.

Used by ``aiprof trigger --server`` (and usable from Python). Standard library only.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from aiprof.protocol import CaptureRequest
from aiprof.errors import AiprofError
from aiprof.server.client import ServerClient, ServerError

FINAL = ("analysed", "failed")


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ServerError as exc:
        raise AiprofError(str(exc)) from None


def list_jobs(client: ServerClient) -> dict[str, list[dict]]:
    """Live jobs: job id -> its agents (rank, host, pid, steps, ...)."""
    return _call(lambda: client.get("jobs"))["jobs"]


def resolve_job(client: ServerClient, job: str | None) -> str:
    """``job`` itself, or the only live job when none is given."""
    if job:
        return job
    jobs = list_jobs(client)
    if len(jobs) == 1:
        return next(iter(jobs))
    raise AiprofError("--job is needed: live jobs are " + (", ".join(sorted(jobs)) or "none"))


def capture_job(client: ServerClient, job: str, req: CaptureRequest, auto_analyze: bool, timeout: float,
                progress: Callable[[str], None] | None = None, explicit_id: bool = False) -> dict:
    """Trigger a capture of every rank of ``job`` and wait (bounded) until it is analysed
    (``auto_analyze``) or uploaded; returns the capture's final state from the server."""
    body = req.to_dict()
    if not explicit_id:
        body.pop("capture_id", None)
    for k in ("out", "start_at", "trigger"):
        body.pop(k, None)
    started = _call(lambda: client.post(f"jobs/{job}/captures", {"request": body, "auto_analyze": auto_analyze,
                                                                 "timeout_s": timeout}))
    cid = started["capture_id"]
    if progress:
        when = (f"from iteration {started['start_at']}" if started.get("start_at") is not None else
                "at a common start time" if started.get("start_unix_ns") else "at the next iteration")
        progress(f"capture {cid}: job {started['job']}, ranks {', '.join(map(str, started['ranks']))}, {when}")
    deadline = time.monotonic() + timeout + 30
    st: dict = {}
    while time.monotonic() < deadline:
        try:
            st = client.get(f"captures/{cid}")
        except ServerError as exc:
            if exc.status is not None:
                raise AiprofError(str(exc)) from None
            time.sleep(1.0)  # the server restarts: its state is on disk, keep asking
            continue
        if st.get("state") in FINAL or (st.get("state") == "uploaded" and not auto_analyze):
            break
        time.sleep(0.3)
    else:
        st["timed_out"] = True
    st.setdefault("url", started.get("url"))
    st.setdefault("capture_id", cid)
    return st


def hang_job(client: ServerClient, job: str, timeout: float = 15.0) -> dict:
    """Stack snapshot of every rank of ``job`` and the server's hang analysis (bounded wait)."""
    started = _call(lambda: client.post(f"jobs/{job}/hang", {"timeout_s": timeout}))
    sid = started["snapshot_id"]
    deadline = time.monotonic() + timeout + 30
    st: dict = {}
    while time.monotonic() < deadline:
        st = _call(lambda: client.get(f"hang/{sid}"))
        if st.get("state") in FINAL:
            return st
        time.sleep(0.2)
    raise AiprofError(f"hang snapshot {sid}: no analysis within {timeout + 30:.0f} s")
