"""Agent lifecycle: one :class:`Agent` per process, started by ``aiprof run`` or ``aiprof attach``.

- ``start_from_env()``: called by the preload hook right after the job imports torch. Reads
  ``AIPROF_AGENT`` (JSON: ``request``, ``entry``, ``runtime_dir``) from the environment.
- ``start_attached(cfg)``: called by the script ``aiprof attach`` injects into a running
  process, on its main thread; writes a status file the CLI waits for.

Both catch every exception: the job must never notice the agent except in its traces.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any

from aiprof.agent import log
from aiprof.agent.capture import CaptureDriver
from aiprof.protocol import CaptureRequest, runtime_dir
from aiprof.agent.control import ControlServer
from aiprof.agent.steps import EntryUnavailable, StepTracker

ENV_VAR = "AIPROF_AGENT"
_AGENT: "Agent | None" = None
_LOCK = threading.Lock()
PATCH_POLL_S = 0.05


def _job_key() -> str:
    """Processes with the same key belong to one job (used to align ranks' iterations)."""
    for var in ("TORCHELASTIC_RUN_ID", "AIPROF_JOB"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    if os.environ.get("MASTER_PORT"):
        return f"master={os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return f"pid={os.getpid()}"


def ineligible_reason(argv: list[str] | None = None) -> str | None:
    """Why this process should not host an agent under ``aiprof run`` (launchers, workers)."""
    argv = list(getattr(sys, "orig_argv", sys.argv)) if argv is None else argv
    joined = " ".join(argv)
    if "--multiprocessing-fork" in argv or "multiprocessing.spawn" in joined or "multiprocessing.forkserver" in joined \
            or "multiprocessing.resource_tracker" in joined:
        return "multiprocessing helper"
    if any(a in ("torch.distributed.run", "torch.distributed.launch") for a in argv) or \
            (len(argv) > 1 and os.path.basename(argv[1]) == "torchrun") or \
            (argv and os.path.basename(argv[0]) == "torchrun"):
        return "torchrun launcher"
    return None


class Agent:
    """Step tracker + capture driver + control server of this process."""

    def __init__(self, origin: str, rt: str | None = None) -> None:
        self.origin = origin
        self.pid = os.getpid()
        self.started_unix_ns = time.time_ns()
        self.driver = CaptureDriver(self)
        self.tracker = StepTracker(self.driver)
        self.control = ControlServer(self, rt)
        self.entry: str | None = None
        self.patch_pending = False
        self.disabled = False
        self.auto: Any = None

    def start(self, entry: str | None = None) -> None:
        self.tracker.install_optimizer_hook()
        from aiprof.agent.collectives import install as install_collectives

        install_collectives(self.origin)  # last collectives entered, for hang snapshots; never raises
        from aiprof.agent import profguard

        profguard.install(self.driver.yield_to_job)  # the job's own torch.profiler comes first; never raises
        if entry:
            self.set_entry(entry)
        self.control.start()
        from aiprof.agent.autotrigger import maybe_start

        self.auto = maybe_start(self)  # $AIPROF_AUTO: slowdown captures, gap snapshots
        atexit.register(self._at_exit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def set_entry(self, entry: str) -> None:
        """Use ``module:qualname`` calls as iterations (wrapped now, or as soon as it exists)."""
        if entry == self.entry:
            return
        self.entry = entry
        self.patch_pending = True
        self._patch_entry()

    def _patch_entry(self) -> None:
        """Try to wrap the entry once; on a target that will never come (renamed, moved, not a
        function), one note on stderr and the job runs on with the optimizer's steps. Never raises."""
        entry = self.entry
        if not entry:
            self.patch_pending = False
            return
        try:
            if self.tracker.try_patch_entry(entry):
                self.patch_pending = False
        except EntryUnavailable as exc:
            self.patch_pending = False
            log.warn_once(f"entry:{entry}", f"--entry {entry} not wrapped: {exc}; the job runs unchanged and "
                                            f"iterations are counted from optimizer.step() instead")
        except Exception as exc:
            self.patch_pending = False
            log.error(f"wrapping --entry {entry}", exc)

    def needs_fast_poll(self) -> bool:
        """Whether the control thread should wake often (20/s) rather than once a second.

        Only while something time-based is pending: an entry to wrap, a wait_ms fallback, a
        time-based capture. An iteration capture in progress needs no polling, and waking the
        control thread costs the training thread a GIL hand-over.
        """
        d = self.driver
        if self.patch_pending:
            return True
        req = d.req
        if d.state == "armed":
            return req is not None and req.wait_ms is not None
        return d.state == "recording" and (d.mode == "time" or d.pending_main is not None)

    def poll(self) -> None:
        """Periodic work on the control thread: pending entry patch, capture timeouts."""
        if self.disabled:
            return
        if self.patch_pending:
            self._patch_entry()
        self.driver.poll()

    def status(self) -> dict[str, Any]:
        from aiprof.agent.capture import rank_info

        t = self.tracker
        age = t.seconds_since_boundary()
        return {
            "pid": self.pid, **rank_info(), "job": _job_key(), "origin": self.origin,
            "cmdline": list(getattr(sys, "orig_argv", sys.argv)), "steps": t.count, "source": t.source,
            "step_ms": t.median_ms(), "last_step_age_s": None if age is None else round(age, 3),
            "state": self.driver.state, "pm_ready": self.driver.pm_ready,
            "pm_off": self.driver.pm_off, "entry": self.entry,
            "entry_pending": self.patch_pending,
            "captures": self.driver.captures_done, "last_result": self.driver.last_result,
            "auto": None if self.auto is None else {"captures": self.auto.captures, "snapshots": self.auto.snapshots,
                                                    "events": self.auto.events[-5:]},
        }

    def _at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        if self.patch_pending and self.entry:  # never wrapped: say why, once, as the job ends
            self._patch_entry()  # its module may have been imported since the last poll: the precise reason
        if self.patch_pending and self.entry:
            mod = self.entry.partition(":")[0]
            why = "the job never imported " + mod if mod not in sys.modules else "its function was never defined"
            log.warn_once(f"entry:{self.entry}", f"--entry {self.entry} was never wrapped ({why}); "
                                                 f"iterations were counted from optimizer.step() instead")
        self.driver.at_exit()
        self.control.close()

    def _after_fork(self) -> None:
        # a forked child (DataLoader worker) inherits our state but not our threads: go quiet
        self.disabled = True
        self.driver.state = "exporting"  # makes the step hooks return at once
        self.tracker.remove_optimizer_hook()


def get_agent() -> "Agent | None":
    """The running agent of this process, if any."""
    return _AGENT if _AGENT is not None and _AGENT.pid == os.getpid() else None


def ensure_agent(origin: str, rt: str | None = None, entry: str | None = None) -> Agent:
    """Start the agent of this process if it is not running yet; returns it."""
    global _AGENT
    with _LOCK:
        a = get_agent()
        if a is None:
            a = Agent(origin, rt)
            a.start(entry)
            _AGENT = a
        elif entry:
            a.set_entry(entry)
        return a


def start_from_env() -> None:
    """The preload hook's entry: start the agent per ``$AIPROF_AGENT``; never raises."""
    try:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return
        cfg = json.loads(raw)
        why = ineligible_reason()
        if why:
            log.info(f"not starting in this process ({why})")
            return
        agent = ensure_agent("run", cfg.get("runtime_dir"), cfg.get("entry"))
        if cfg.get("request"):
            req = CaptureRequest.from_dict(cfg["request"])
            err = agent.driver.submit(req)
            if err:
                log.warn_once("run-submit", f"capture not armed: {err}")
        if cfg.get("server"):  # aiprof run --server: register, heartbeat, upload (agent/uplink.py)
            from aiprof.agent.uplink import start_uplink

            start_uplink(agent, cfg["server"])
    except Exception as exc:
        log.error("agent start", exc)


def _torch_initializing() -> bool:
    """True while ``import torch`` is still running (attach can land in the middle of it)."""
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return bool(getattr(spec, "_initializing", False)) or (torch is not None and not hasattr(torch, "optim"))


def start_attached(cfg: dict[str, Any]) -> None:
    """The injected script's entry (main thread): start the agent and report to the CLI.

    If the pending call landed while the job was still importing torch, importing torch.optim
    now would break that import; a short-lived thread waits (bounded) until it has finished.
    """
    if "torch" in sys.modules and _torch_initializing():
        def later() -> None:
            deadline = time.monotonic() + 120
            while _torch_initializing() and time.monotonic() < deadline:
                time.sleep(0.05)
            _start_attached_now(cfg)

        threading.Thread(target=later, name="aiprof-attach-wait", daemon=True).start()
        return
    _start_attached_now(cfg)


def _start_attached_now(cfg: dict[str, Any]) -> None:
    status: dict[str, Any] = {"pid": os.getpid()}
    try:
        if _torch_initializing():
            status.update(ok=False, error="torch is still being imported in the target; try again in a moment")
        elif "torch" not in sys.modules:
            status.update(ok=False, error="torch is not imported in the target process")
        else:
            rt = cfg.get("runtime_dir") or runtime_dir()
            agent = ensure_agent("attach", rt, cfg.get("entry"))
            if cfg.get("server"):  # aiprof attach --server (agent/uplink.py)
                from aiprof.agent.uplink import start_uplink

                start_uplink(agent, cfg["server"])
            import torch

            if agent.control.refused:  # the CLI could never reach it: say why instead of timing out
                status.update(ok=False, error=f"agent started, but {agent.control.refused}")
            else:
                status.update(ok=True, socket=agent.control.path, torch=torch.__version__,
                              python=sys.version.split()[0], steps=agent.tracker.count)
    except Exception as exc:
        status.update(ok=False, error=f"agent start failed: {type(exc).__name__}: {exc}")
    path = cfg.get("status_path")
    if path:
        try:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(status, f)
            os.replace(tmp, path)
        except Exception as exc:
            log.error("attach status file", exc)
