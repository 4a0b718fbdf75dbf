"""Asking running agents to capture, so that all ranks of a job record the same iterations.

Each agent counts iterations from its own start; ranks of one job (same torchrun run id or
master address) step in lockstep, so the trigger reads every agent's count and asks all of a
job's ranks to start at the same iteration number: the highest count plus a margin of about
half a second of iterations (at least ``--skip``). A capture with PM counters gets more room: the
sampler's set-up, and its library and metrics where an agent has not resolved them yet
(protocol.pm_lead_s), so that every rank records the same iterations with samples.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from aiprof.protocol import CaptureRequest, pm_lead_s
from aiprof.agent.control import Endpoint, capture_all, discover, status
from aiprof.errors import AiprofError

ALIGN_MARGIN_S = 0.5
MAX_MARGIN_ITERS = 50


@dataclass
class Agent:
    """An agent that answered its status request."""

    endpoint: Endpoint
    status: dict[str, Any]

    @property
    def pid(self) -> int:
        return self.endpoint.pid


def find_agents(pids: list[int] | None = None, rt_dirs: list[str] | None = None) -> list[Agent]:
    """Live agents on this host (optionally only these pids)."""
    out = []
    for ep in discover(rt_dirs):
        if pids is not None and ep.pid not in pids:
            continue
        st = status(ep)
        if st is not None:
            out.append(Agent(ep, st))
    return out


def plan_requests(agents: list[Agent], req: CaptureRequest) -> dict[int, CaptureRequest]:
    """One request per agent; iteration captures of one job get a common ``start_at``."""
    plans: dict[int, CaptureRequest] = {}
    jobs: dict[str, list[Agent]] = {}
    for a in agents:
        jobs.setdefault(str(a.status.get("job")), []).append(a)
    for members in jobs.values():
        start_at = None
        stepping = [a for a in members if (a.status.get("steps") or 0) > 0]
        if req.start_at is None and stepping:
            top = max(int(a.status["steps"]) for a in stepping)
            meds = [a.status.get("step_ms") for a in stepping if a.status.get("step_ms")]
            step_ms = max(meds) if meds else 100.0
            margin = min(MAX_MARGIN_ITERS, max(1, math.ceil(ALIGN_MARGIN_S * 1e3 / max(step_ms, 1e-3))))
            lead = pm_lead_s(req.what, req.hw_pm_interval_us,
                             all(a.status.get("pm_ready") or a.status.get("pm_off") for a in stepping),
                             all(a.status.get("pm_off") for a in stepping))
            margin += math.ceil(lead * 1e3 / max(step_ms, 1e-3))
            start_at = top + max(req.skip, margin)
        for a in members:
            r = copy.deepcopy(req)
            if start_at is not None and (a.status.get("steps") or 0) > 0:
                r.start_at = start_at
            plans[a.pid] = r
    return plans


def trigger(req: CaptureRequest, pids: list[int] | None = None, timeout: float = 120.0,
            rt_dirs: list[str] | None = None) -> dict[int, dict]:
    """Ask every agent (or those of ``pids``) to capture; wait for all; pid -> result."""
    agents = find_agents(pids, rt_dirs)
    if not agents:
        where = "for " + ", ".join(map(str, pids)) if pids else "on this host"
        raise AiprofError(f"no aiprof agent is running {where} (start the job with aiprof run, or aiprof attach PID)")
    plans = plan_requests(agents, req)
    return capture_all([a.endpoint for a in agents], plans, timeout)
