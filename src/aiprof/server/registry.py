"""Agents known to the service, grouped by job; per-agent command queues; job-wide planning.

The registry lives in memory: agents re-register by themselves when a restarted server
answers their heartbeat with 404, so nothing of it needs to survive a restart (captures do,
in the store).

Agreeing on iterations (docs/server.md, "One trigger for a whole job"): ranks of a
synchronous job step in lockstep, and each agent counts iterations from its own start, so the
counts of a job's ranks agree. The server estimates each rank's current iteration from its
last heartbeat (count + time since / step time), takes the highest, and adds a margin that
covers the time a command needs to reach every rank (one heartbeat interval plus slack). Every
rank gets the same ``start_at``; the capture driver records iterations ``start_at ..
start_at+N-1`` and names them ``ProfilerStep#<k>``, so the ranks' traces line up by name.
Duration captures get a common wall-clock start instead (``start_unix_ns``), the same margin
ahead; each agent submits its request at that instant and recording starts at its next
iteration boundary.
"""
from __future__ import annotations

import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_S = 1.0
ALIVE_FACTOR = 5  # an agent is alive while its last heartbeat is younger than this many intervals
MARGIN_S = 0.75  # slack on top of one heartbeat interval (request latency, GIL, scheduling)
MAX_START_ITERS = 100_000
MAX_COMMANDS = 16  # per agent: a stuck agent cannot make the server grow
# Agents registered from one network address. A node runs one agent per rank (8-16) plus a few
# helpers; 256 leaves room for big nodes and addresses shared through NAT, and keeps one client
# from registering thousands (each 500 agents stretch every agent's heartbeat by a second).
MAX_AGENTS_PER_ADDRESS = 256


class TooManyAgents(Exception):
    """A registration past MAX_AGENTS_PER_ADDRESS live agents of one address."""


@dataclass
class AgentInfo:
    """One agent (one process of a job) as it registered, plus its latest heartbeat."""

    agent_id: str
    job: str
    host: str
    pid: int
    rank: int
    world_size: int
    info: dict[str, Any]
    peer: str = ""  # the network address it registered from (not what it claims: ``host``)
    registered: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    steps: int = 0
    step_ms: float | None = None
    state: str = "idle"
    pm_ready: bool = False  # its PM sampler's library and metrics are resolved (protocol.pm_lead_s)
    pm_off: bool = False  # it will not sample PM counters: no CUDA in use, or PM failed there for good
    commands: deque = field(default_factory=lambda: deque(maxlen=MAX_COMMANDS))

    def estimated_steps(self, now: float) -> float:
        """The iteration this rank has probably reached now (heartbeats are up to one interval old)."""
        if not self.step_ms or self.steps <= 0:
            return float(self.steps)
        return self.steps + (now - self.last_seen) * 1e3 / self.step_ms

    def public(self, now: float, interval: float) -> dict[str, Any]:
        return {"agent_id": self.agent_id, "job": self.job, "host": self.host, "pid": self.pid, "rank": self.rank,
                "world_size": self.world_size, "steps": self.steps, "step_ms": self.step_ms, "state": self.state,
                "last_seen_s": round(now - self.last_seen, 3), "alive": self.alive(now, interval),
                "origin": self.info.get("origin"), "job_source": self.info.get("job_source")}

    def alive(self, now: float, interval: float) -> bool:
        return now - self.last_seen < ALIVE_FACTOR * interval + 2.0


class Registry:
    """Thread-safe registry of agents (the API runs on one event loop; tests poke it directly)."""

    def __init__(self, interval_s: float = HEARTBEAT_S, max_per_address: int = MAX_AGENTS_PER_ADDRESS) -> None:
        self.base_interval = interval_s
        self.max_per_address = max_per_address
        self.agents: dict[str, AgentInfo] = {}
        self.per_peer: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def interval(self) -> float:
        """Heartbeat period told to agents: 1 s, stretched for big fleets (~500 heartbeats/s at most)."""
        return max(self.base_interval, len(self.agents) / 500.0)

    def register(self, agent_id: str, job: str, info: dict[str, Any], peer: str = "") -> AgentInfo:
        """Add or refresh an agent; TooManyAgents when ``peer`` has its limit of live agents."""
        with self._lock:
            old = self.agents.get(agent_id)
            if (old is None or old.peer != peer) and self.per_peer.get(peer, 0) >= self.max_per_address:
                now = time.time()  # first make room by forgetting the address's dead agents
                for k in [k for k, x in self.agents.items() if x.peer == peer and not x.alive(now, self.interval)]:
                    self._forget(k)
                if self.per_peer.get(peer, 0) >= self.max_per_address:
                    raise TooManyAgents(f"{self.max_per_address} agents are registered from {peer or 'this address'} "
                                        "already (aiprof server --max-agents-per-host raises the limit)")
            a = AgentInfo(agent_id=agent_id, job=job, peer=peer, host=str(info.get("host", ""))[:256], pid=int(info.get("pid") or 0),
                          rank=int(info.get("rank") or 0), world_size=int(info.get("world_size") or 1),
                          info={k: info.get(k) for k in ("origin", "job_source", "local_rank", "cmdline", "python", "torch")})
            if old is not None:
                a.commands = old.commands  # a re-registration keeps what was queued for it
                a.registered = old.registered
            self._beat(a, info)
            if old is not None:
                self._forget(agent_id)
            self.agents[agent_id] = a
            self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
            return a

    def _forget(self, agent_id: str) -> None:
        a = self.agents.pop(agent_id)
        n = self.per_peer.get(a.peer, 0) - 1
        if n > 0:
            self.per_peer[a.peer] = n
        else:
            self.per_peer.pop(a.peer, None)

    def heartbeat(self, agent_id: str, info: dict[str, Any]) -> tuple[AgentInfo, list[dict]] | None:
        """Record a heartbeat; returns the agent and its pending commands (taken), or None if unknown."""
        with self._lock:
            a = self.agents.get(agent_id)
            if a is None:
                return None
            self._beat(a, info)
            cmds = list(a.commands)
            a.commands.clear()
            return a, cmds

    @staticmethod
    def _beat(a: AgentInfo, info: dict[str, Any]) -> None:
        a.last_seen = time.time()
        try:
            a.steps = int(info.get("steps") or 0)
            sm = info.get("step_ms")
            a.step_ms = float(sm) if sm else None
        except (TypeError, ValueError):
            pass
        a.state = str(info.get("state") or "idle")[:32]
        a.pm_ready = info.get("pm_ready") is True
        a.pm_off = info.get("pm_off") is True

    def jobs(self, alive_only: bool = True) -> dict[str, list[AgentInfo]]:
        now = time.time()
        out: dict[str, list[AgentInfo]] = {}
        with self._lock:
            for a in self.agents.values():
                if alive_only and not a.alive(now, self.interval):
                    continue
                out.setdefault(a.job, []).append(a)
        for v in out.values():
            v.sort(key=lambda a: (a.rank, a.host, a.pid))
        return out

    def job_agents(self, job: str) -> list[AgentInfo]:
        return self.jobs().get(job, [])

    def send(self, agents: list[AgentInfo], command: dict[str, Any]) -> None:
        with self._lock:
            for a in agents:
                a.commands.append(dict(command))

    def forget_dead(self, older_than_s: float = 3600.0) -> int:
        """Drop agents not heard from for an hour (bounded memory over a long-running server)."""
        now = time.time()
        with self._lock:
            dead = [k for k, a in self.agents.items() if now - a.last_seen > older_than_s]
            for k in dead:
                self._forget(k)
        return len(dead)


def plan_start(agents: list[AgentInfo], skip: int, interval_s: float, now: float | None = None,
               lead_s: float = 0.0) -> int | None:
    """The common ``start_at`` iteration for a job's ranks, or None when none of them steps yet.

    ``max(estimated current iteration) + margin``: the margin is the number of iterations that
    pass while the command travels (one heartbeat interval + MARGIN_S, + ``lead_s``: the PM
    sampler's set-up, protocol.PM_SETUP_LEAD_S), at least 2 and at least ``skip``.
    """
    now = time.time() if now is None else now
    stepping = [a for a in agents if a.steps > 0]
    if not stepping:
        return None
    top = max(a.estimated_steps(now) for a in stepping)
    meds = [a.step_ms for a in stepping if a.step_ms]
    step_ms = min(meds) if meds else 100.0  # the fastest rank's pace bounds how far anyone gets
    margin = math.ceil((interval_s + MARGIN_S + lead_s) * 1e3 / max(step_ms, 1e-3)) + 1
    return int(min(math.ceil(top) + max(skip, margin, 2), MAX_START_ITERS + math.ceil(top)))


def plan_start_time(interval_s: float, now_ns: int | None = None) -> int:
    """Common wall-clock start (unix ns) for duration captures: one interval + margin ahead."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    return now_ns + int((interval_s + MARGIN_S) * 1e9)


def new_id(prefix: str = "") -> str:
    """``20260101-120000-ab12cd``: sortable, unique enough for captures and snapshots."""
    return prefix + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
