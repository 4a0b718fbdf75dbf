"""Auto-trigger: the agent watches its own step times and captures by itself.

Always on once enabled (``$AIPROF_AUTO``: ``1`` or a JSON object of :class:`AutoConfig` fields;
``aiprof run --auto``). The step tracker already keeps every iteration's duration (one clock
read and a deque append per step); a daemon thread looks at them twice a second:

* **slowdown**: once a baseline exists (median of ``baseline_steps`` iterations after
  ``warmup_steps``), when the median of the last ``recent_steps`` iterations is at least
  ``slowdown_ratio`` × baseline, it submits a capture of the next ``capture_iterations``
  iterations (the slow ones, if the slowdown lasts);
* **gap**: when no iteration has completed for ``gap_s`` seconds (after at least one), it writes
  a stack snapshot of all threads (``sys._current_frames``: no ptrace, no py-spy needed).
  Expected gaps are recognised: if the main thread is inside a function whose name contains
  one of ``expected_gap_words`` (checkpoint, save, eval, validate...), the gap is logged as
  expected and only snapshotted past ``expected_gap_factor`` × ``gap_s`` (once that function has
  returned, the rest of the gap counts from its end); the first gap of the
  run (compilation, first evaluation, data-loader start) gets ``first_gap_factor`` × ``gap_s``.

Both are rate-limited (``min_interval_s`` between auto actions of one kind, ``max_captures``,
``max_snapshots``). Why each was taken is written into its meta.json under ``trigger``.
Nothing here may raise into the job: every failure is logged once.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiprof.agent import log

ENV_VAR = "AIPROF_AUTO"
SNAPSHOT_SCHEMA = "aiprof.snapshot/1"


@dataclass
class AutoConfig:
    """Auto-trigger settings (all optional in ``$AIPROF_AUTO``)."""

    slowdown_ratio: float = 1.2  # recent median / baseline median that triggers a capture
    slowdown_min_ms: float = 5.0  # and at least this much slower: OS jitter on short steps is no slowdown
    warmup_steps: int = 5  # iterations ignored at the start (compilation, autotuning, caches)
    baseline_steps: int = 20  # iterations whose median is the baseline
    recent_steps: int = 5  # iterations whose median is compared with it
    capture_iterations: int = 3
    gap_s: float = 300.0  # no iteration for this long: stack snapshot
    first_gap_factor: float = 2.0  # the run's first gap may last this many times gap_s
    expected_gap_factor: float = 4.0  # a gap inside checkpoint/eval code may last this many times gap_s
    expected_gap_words: tuple[str, ...] = ("checkpoint", "save", "eval", "validat", "test_loop", "export")
    min_interval_s: float = 600.0  # between two auto captures (and between two snapshots)
    max_captures: int = 3
    max_snapshots: int = 3
    poll_s: float = 0.5
    out: str = "aiprof-captures"
    what: tuple[str, ...] = ("kernels",)

    @classmethod
    def from_env(cls, raw: str | None) -> "AutoConfig | None":
        """Parse ``$AIPROF_AUTO``; None when auto-trigger is off."""
        if not raw or raw.strip().lower() in ("0", "false", "off", "no"):
            return None
        if raw.strip().lower() in ("1", "true", "on", "yes"):
            return cls()
        d = json.loads(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.expected_gap_words = tuple(cfg.expected_gap_words)
        cfg.what = tuple(cfg.what)
        return cfg


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2.0 if n else 0.0


def slowdown(durations_s: list[float], cfg: AutoConfig) -> dict | None:
    """The slowdown trigger's decision over a list of iteration durations (oldest first)."""
    need = cfg.warmup_steps + cfg.baseline_steps + cfg.recent_steps
    if len(durations_s) < need:
        return None
    base = _median(durations_s[cfg.warmup_steps:cfg.warmup_steps + cfg.baseline_steps])
    recent = _median(durations_s[-cfg.recent_steps:])
    if base <= 0 or recent < cfg.slowdown_ratio * base or (recent - base) * 1e3 < cfg.slowdown_min_ms:
        return None
    # scope "rank": this rank alone decided, under its own capture id (the server waits for no other)
    return {"reason": "slowdown", "scope": "rank", "baseline_ms": round(base * 1e3, 3),
            "recent_ms": round(recent * 1e3, 3), "ratio": round(recent / base, 3), "threshold_ratio": cfg.slowdown_ratio,
            "min_extra_ms": cfg.slowdown_min_ms,
            "recent_steps_ms": [round(x * 1e3, 3) for x in durations_s[-cfg.recent_steps:]]}


def thread_stacks() -> list[dict[str, Any]]:
    """Every Python thread's stack, innermost frame first, in `aiprof stacks`' format."""
    frames = sys._current_frames()
    info = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, f in frames.items():
        t = info.get(ident)
        chain = []
        while f is not None and len(chain) < 256:
            co = f.f_code
            chain.append({"function": co.co_name, "file": co.co_filename, "line": f.f_lineno, "native": False})
            f = f.f_back
        out.append({"thread_id": ident, "os_thread_id": getattr(t, "native_id", None) if t else None,
                    "name": t.name if t else None, "active": None, "owns_gil": None, "frames": chain})
    return out


def expected_gap(frames: list[dict], words: tuple[str, ...]) -> str | None:
    """The checkpoint/eval-like function the main thread is in (innermost match), or None."""
    for f in frames:
        name = str(f.get("function", "")).lower()
        if any(w in name for w in words):
            return str(f["function"])
    return None


class AutoTrigger:
    """Watches the agent's step tracker from a daemon thread (see the module doc)."""

    def __init__(self, agent: Any, cfg: AutoConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        self.captures = 0
        self.snapshots = 0
        self.last_capture_t = -1e18
        self.last_snapshot_t = -1e18
        self.gaps_seen = 0
        self._gap_done_at: int | None = None  # step count when the current gap was handled
        self._gap_logged_at: int | None = None
        # (step count, when) the main thread was last seen in an expected gap's function: a gap
        # that was a checkpoint counts, once it has ended, from its end (see _check_gap)
        self._expected_seen: tuple[int, float] | None = None
        self.events: list[dict] = []  # what it decided, for status and tests (bounded)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="aiprof-auto", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _note(self, ev: dict) -> None:
        self.events.append(ev)
        del self.events[:-50]
        log.info(f"auto-trigger: {ev}")

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            try:
                if getattr(self.agent, "disabled", False):
                    return
                self.poll()
            except Exception as exc:
                log.error("auto-trigger", exc)

    # -- decisions ------------------------------------------------------------------------------
    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        tr = self.agent.tracker
        self._check_gap(tr, now)
        if self.captures >= self.cfg.max_captures or now - self.last_capture_t < self.cfg.min_interval_s:
            return
        if self.agent.driver.state != "idle":
            return
        dec = slowdown(list(tr.durations), self.cfg)
        if dec is None:
            return
        from aiprof.protocol import CaptureRequest

        dec.update(at_step=tr.count, unix_ns=time.time_ns(), auto_capture=self.captures + 1)
        req = CaptureRequest(out=self.cfg.out, what=self.cfg.what, iterations=self.cfg.capture_iterations,
                             warmup=False, trigger=dec).normalised()
        err = self.agent.driver.submit(req)
        if err:
            return  # busy (someone else's capture): try again later
        self.captures += 1
        self.last_capture_t = now
        self._note({"action": "capture", "capture_id": req.capture_id, **dec})

    def _check_gap(self, tr: Any, now: float) -> None:
        age = tr.seconds_since_boundary()
        count = tr.count
        if age is None or count < 1 or self._gap_done_at == count:
            return
        d = self.agent.driver
        if getattr(d, "holding_since", None) is not None:
            return  # the agent itself is starting or stopping its profiler on the job's thread
        held = getattr(d, "held_until", None)
        if held is not None:  # a gap counts from the end of the agent's own work, not before it
            age = min(age, time.perf_counter() - held)
        cfg = self.cfg
        limit = cfg.gap_s * (cfg.first_gap_factor if self.gaps_seen == 0 else 1.0)
        if age < min(limit, cfg.gap_s):
            return
        stacks = thread_stacks()
        main = next((t for t in stacks if t["thread_id"] == threading.main_thread().ident), None)
        where = expected_gap(main["frames"] if main else [], cfg.expected_gap_words)
        if where:
            self._expected_seen = (count, now)
        elif self._expected_seen is not None and self._expected_seen[0] == count:
            # the checkpoint has ended but the step it interrupted has not yet: the main thread is
            # back in the step's own work, no stall (yet). A stall after it counts from its end
            age = min(age, now - self._expected_seen[1])
        if where:
            if self._gap_logged_at != count:
                self._gap_logged_at = count
                self._note({"action": "expected_gap", "function": where, "age_s": round(age, 3), "at_step": count})
            limit = max(limit, cfg.gap_s * cfg.expected_gap_factor)
        if age < limit:
            return
        self._gap_done_at = count
        self.gaps_seen += 1
        if self.snapshots >= cfg.max_snapshots or now - self.last_snapshot_t < cfg.min_interval_s:
            return
        why = {"reason": "gap", "no_step_for_s": round(age, 3), "gap_s": cfg.gap_s, "limit_s": limit,
               "at_step": count, "expected_gap_function": where, "first_gap": self.gaps_seen == 1,
               "last_step_ms": tr.recent_ms(5), "unix_ns": time.time_ns()}
        path = self.write_snapshot(stacks, why)
        self.snapshots += 1
        self.last_snapshot_t = now
        self._note({"action": "snapshot", "dir": path, **{k: why[k] for k in ("no_step_for_s", "at_step")}})

    def write_snapshot(self, stacks: list[dict], why: dict) -> str:
        """Write <out>/<id>/rank<r>/stacks.json (aiprof hang --from reads it) and meta.json."""
        from aiprof.agent.capture import rank_info
        from aiprof.protocol import new_capture_id

        ri = rank_info()
        d = os.path.join(self.cfg.out, "snap-" + new_capture_id(), f"rank{ri['rank']}")
        os.makedirs(d, exist_ok=True)
        host = socket.gethostname()
        from aiprof.agent.collectives import snapshot as collectives_snapshot

        proc = {"pid": os.getpid(), "rank": ri["rank"], "host": host, "ok": True, "error": None,
                "source": "sys._current_frames", "threads": stacks, "last_collectives": collectives_snapshot()}
        with open(os.path.join(d, "stacks.json"), "w") as f:
            json.dump([proc], f, indent=1, default=str)
        meta = {"schema": SNAPSHOT_SCHEMA, "kind": "stacks", "trigger": why, "host": host, "pid": os.getpid(),
                **ri, "cmdline": list(getattr(sys, "orig_argv", sys.argv)), "files": {"stacks": "stacks.json"}}
        tmp = os.path.join(d, "meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1, default=str)
        os.replace(tmp, os.path.join(d, "meta.json"))
        return d


def maybe_start(agent: Any) -> "AutoTrigger | None":
    """Start the auto-trigger of ``agent`` if ``$AIPROF_AUTO`` asks for it; never raises."""
    try:
        cfg = AutoConfig.from_env(os.environ.get(ENV_VAR))
        if cfg is None:
            return None
        at = AutoTrigger(agent, cfg)
        at.start()
        return at
    except Exception as exc:
        log.error(f"auto-trigger setup (${ENV_VAR})", exc)
        return None
