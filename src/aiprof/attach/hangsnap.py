"""Hang snapshot of a job: find its workers, dump their stacks at once (py-spy), analyse.

Workers of a job are found through /proc (same user, or root): Python processes whose
environment names a rank (``RANK``) and a job (``TORCHELASTIC_RUN_ID``, ``AIPROF_JOB`` or
``MASTER_ADDR:MASTER_PORT``, the same key the agent uses). Children of a worker that inherit its
environment (DataLoader workers, compile workers) and launchers are left out.

Workers that run an aiprof agent (``aiprof run``/``attach``) are also asked, over their control
socket, for the last collectives they entered (agent/collectives.py): that is what tells an NCCL
hang apart, where the waiting ranks' stacks have already left the collective. Without py-spy, the
agents' own stacks (``sys._current_frames``) stand in for py-spy's.
"""
from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiprof.analysis.hang import analyse
from aiprof.attach.procs import AttachError, is_launcher_or_helper, resolve_targets
from aiprof.attach.stacks import dump_one, find_py_spy
from aiprof.errors import AiprofError

MAX_PARALLEL_DUMPS = 16  # py-spy pauses each target briefly; dump workers together, bounded
AGENT_TIMEOUT_S = 8.0  # per agent: its reply waits for a flight recorder dump (bounded at 3 s there)


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def job_key(env: dict[str, str]) -> str | None:
    """The job a process belongs to, from its environment (None: not a distributed worker)."""
    for var in ("TORCHELASTIC_RUN_ID", "AIPROF_JOB"):
        if env.get(var):
            return f"{var}={env[var]}"
    if env.get("MASTER_PORT"):
        return f"master={env.get('MASTER_ADDR', '')}:{env['MASTER_PORT']}"
    return None


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _is_aiprof_cli(cmd: list[str]) -> bool:
    """``aiprof run -- python train.py`` started with RANK set: the CLI, not the worker (its child)."""
    head = cmd[:3]
    return any(os.path.basename(a) == "aiprof" for a in head[:2]) or \
        any(a == "-m" and b == "aiprof" for a, b in zip(head, head[1:]))


def find_jobs() -> dict[str, list[dict[str, Any]]]:
    """Distributed workers on this host, by job key: [{"pid", "rank", "world_size"}] sorted by rank."""
    cand: dict[int, dict[str, Any]] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        env = _environ(pid)
        key = job_key(env)
        if key is None or "RANK" not in env:
            continue
        cmd = _cmdline(pid)
        if not cmd or is_launcher_or_helper(cmd) or _is_aiprof_cli(cmd):
            continue
        try:
            rank = int(env["RANK"])
        except ValueError:
            continue
        ws = env.get("WORLD_SIZE")
        cand[pid] = {"pid": pid, "rank": rank, "world_size": int(ws) if ws and ws.isdigit() else None, "job": key}
    jobs: dict[str, list[dict[str, Any]]] = {}
    for pid, c in cand.items():
        parent = cand.get(_ppid(pid) or -1)
        if parent is not None and parent["rank"] == c["rank"] and parent["job"] == c["job"]:
            continue  # a worker's child (DataLoader worker, fork): not a rank of its own
        jobs.setdefault(c["job"], []).append(c)
    for v in jobs.values():
        v.sort(key=lambda c: (c["rank"], c["pid"]))
    return jobs


def pick_job(job: str | None) -> list[dict[str, Any]]:
    """The workers of ``job`` (a key or a substring of it), or of the only job on this host."""
    jobs = find_jobs()
    if not jobs:
        raise AttachError("no distributed job found on this host (no Python process with RANK and "
                          "MASTER_PORT/TORCHELASTIC_RUN_ID in its environment that this user may read)")
    if job:
        hits = {k: v for k, v in jobs.items() if job in k}
        if len(hits) != 1:
            raise AttachError(f"--job {job!r} matches {len(hits)} of the jobs here: {', '.join(sorted(jobs))}")
        return next(iter(hits.values()))
    if len(jobs) > 1:
        raise AttachError(f"{len(jobs)} jobs on this host; pick one with --job KEY: {', '.join(sorted(jobs))}")
    return next(iter(jobs.values()))


def rank_of(pid: int) -> int | None:
    """The rank a process's environment names, or None."""
    try:
        return int(_environ(pid)["RANK"])
    except (KeyError, ValueError):
        return None


def agent_reports(pids: list[int], op: str = "collectives", timeout: float = AGENT_TIMEOUT_S) -> dict[int, dict]:
    """Ask the agents among ``pids`` for ``op`` (``collectives`` or ``stacks``); pid -> reply.

    Processes without an agent socket are left out; an agent that does not answer in time too.
    """
    from aiprof.agent.control import ask, discover

    want = set(pids)
    eps = [e for e in discover() if e.pid in want]
    if not eps:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_DUMPS, len(eps))) as ex:
        replies = list(ex.map(lambda e: ask(e, op, timeout), eps))
    return {e.pid: r for e, r in zip(eps, replies) if isinstance(r, dict)}


def snapshot(pids: list[int], ranks: list[int | None] | None = None, native: bool = False,
             timeout: float = 20.0) -> dict[str, Any]:
    """Dump the stacks of ``pids`` together, add their agents' last collectives, analyse.

    Stacks come from py-spy; where py-spy is missing or fails on a process that has an agent,
    from the agent itself. Raises AiprofError when py-spy is missing and no process has an agent.
    """
    try:
        exe: str | None = find_py_spy()
    except AiprofError:
        exe = None
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_DUMPS, max(len(pids), 1)) + 1) as ex:
        agents_f = ex.submit(agent_reports, pids, "collectives" if exe else "stacks")
        dumps = list(ex.map(lambda p: dump_one(p, native, timeout, exe), pids)) if exe else None
        agents = agents_f.result()
    if dumps is None:
        if not agents:
            find_py_spy()  # raises its "py-spy not found" error: nothing else can read a stack
        dumps = [{"pid": p, "ok": p in agents, "error": None if p in agents else "py-spy not found and no agent",
                  "native": False, "source": "agent", "threads": (agents.get(p) or {}).get("threads") or []}
                 for p in pids]
    else:
        failed = [d["pid"] for d in dumps if not d["ok"] and d["pid"] in agents]
        if failed:  # py-spy refused (permissions, an unsupported Python): the agent can still tell
            again = agent_reports(failed, "stacks")
            for d in dumps:
                a = again.get(d["pid"])
                if a and a.get("threads"):
                    d.update(ok=True, source="agent", py_spy_error=d["error"], error=None, threads=a["threads"])
    host = socket.gethostname()
    ranks = ranks if ranks is not None else [rank_of(p) for p in pids]
    for d, r in zip(dumps, ranks):
        d["rank"] = r
        d["host"] = host
        a = agents.get(d["pid"])
        if a and a.get("last_collectives"):
            d["last_collectives"] = a["last_collectives"]
    res = analyse(dumps)
    res["host"] = host
    return res


def targets(pids: list[str] | None, name: str | None, job: str | None, whole_job: bool) -> tuple[list[int], list[int | None]]:
    """Resolve the CLI's PID.../--name/--job into pids and their ranks."""
    out: list[int] = []
    if whole_job:
        ws = pick_job(job)
        return [w["pid"] for w in ws], [w["rank"] for w in ws]
    if pids:
        out += resolve_targets(list(pids))
    if name:
        out += resolve_targets([name])
    if not out:
        raise AttachError("give PIDs, --name NAME or --job")
    seen: set[int] = set()
    out = [p for p in out if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]
    return out, [rank_of(p) for p in out]
