"""Auto-trigger: a job that slows down gets captured, a stalled one gets a stack snapshot,
with no command from outside."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

from capsupport import PY, SCRIPTS, aiprof, load_meta, load_trace, profiler_steps

from aiprof.agent.autotrigger import AutoConfig, AutoTrigger, expected_gap, slowdown, thread_stacks

SCRIPT = SCRIPTS / "slowdown_train.py"
FAST = 16
FAST_MS = 100


def _dirs(out: Path, pattern: str) -> list[Path]:
    return sorted(p.parent for p in out.glob(pattern))


def test_slowdown_and_gap_are_caught_by_the_agent(rt, tmp_path):
    """Steps of 100 ms (sleep-bound) against a 2x threshold: a loaded machine's scheduling noise
    (tens of ms) is far from both; the slow steps last 4x the job's own fast median and go on
    until the capture exists. What the test sees does not depend on timing."""
    out = tmp_path / "caps"
    auto = {"warmup_steps": 3, "baseline_steps": 10, "recent_steps": 3, "capture_iterations": 3,
            "slowdown_ratio": 2.0, "gap_s": 1.0, "first_gap_factor": 1.0, "expected_gap_factor": 10.0,
            "min_interval_s": 0.0, "poll_s": 0.1}
    r = aiprof(rt, "run", "--out", str(out), "--auto", json.dumps(auto), "--",
               PY, str(SCRIPT), "--fast", str(FAST), "--fast-ms", str(FAST_MS), "--slow", "3", "--slow-factor", "4",
               "--slow-until", str(out / "*" / "rank0" / "trace.json.gz"), "--gap-s", "3.0", "--ckpt-s", "3.0",
               timeout=150)
    assert r.returncode == 0, r.stderr
    caps = _dirs(out, "*/rank*/trace.json.gz")
    assert caps, f"no auto capture in {out}: {r.stderr[-2000:]}"
    meta = load_meta(caps[0])
    trig = meta["trigger"]
    assert trig["reason"] == "slowdown" and trig["threshold_ratio"] == 2.0
    assert trig["ratio"] >= 2.0 and trig["recent_ms"] >= 2.0 * trig["baseline_ms"]
    # the captured iterations are the slow ones (numbered by the job's own count)
    steps = profiler_steps(load_trace(caps[0]))
    assert len(steps) == 3 and min(steps) >= FAST
    assert min(meta["steps"]["during_ms"]) > 2.0 * trig["baseline_ms"]
    # the stall in stuck_read() got a stack snapshot that names it (the agent's own profiler
    # start and stop, a second or more on a loaded machine, are not taken for one)...
    snaps = _dirs(out, "snap-*/rank*/stacks.json")
    assert len(snaps) == 1, r.stderr[-2000:]
    sm = json.loads((snaps[0] / "meta.json").read_text())
    assert sm["trigger"]["reason"] == "gap" and sm["trigger"]["no_step_for_s"] >= 1.0
    assert sm["trigger"]["expected_gap_function"] is None
    (proc,) = json.loads((snaps[0] / "stacks.json").read_text())
    main = [t for t in proc["threads"] if t["name"] == "MainThread"][0]
    assert [f["function"] for f in main["frames"][:2]] == ["stuck_read", "main"]
    # ...and the checkpoint that followed was recognised as an expected gap: no second snapshot
    hang = aiprof(rt, "hang", "--from", str(snaps[0] / "stacks.json"), "--json")
    assert json.loads(hang.stdout)["groups"][0]["at"].startswith("stuck_read")


def test_no_capture_when_the_job_keeps_its_pace(rt, tmp_path):
    """The default thresholds (1.2x and +5 ms) on 300 ms sleep-bound steps: the scheduling noise
    of a loaded machine (tens of ms) stays under 20 %."""
    out = tmp_path / "caps"
    auto = {"warmup_steps": 3, "baseline_steps": 10, "recent_steps": 3, "gap_s": 5.0, "poll_s": 0.1}
    r = aiprof(rt, "run", "--out", str(out), "--auto", json.dumps(auto), "--",
               PY, str(SCRIPT), "--fast", "22", "--slow", "0", "--fast-ms", "300", timeout=120)
    assert r.returncode == 0, r.stderr
    assert not list(out.glob("*/rank*/meta.json"))


def test_slowdown_rule_and_expected_gap_names():
    cfg = AutoConfig(warmup_steps=2, baseline_steps=4, recent_steps=2)
    base = [0.5, 0.3] + [0.1] * 4
    assert slowdown(base + [0.11, 0.115], cfg) is None  # +15 %: below 1.2x
    d = slowdown(base + [0.12, 0.13], cfg)
    assert d["reason"] == "slowdown" and d["ratio"] == 1.25 and d["baseline_ms"] == 100.0
    assert slowdown(base, cfg) is None  # not enough steps yet
    short = [0.5, 0.3] + [0.008] * 4
    assert slowdown(short + [0.010, 0.0105], cfg) is None  # 1.3x but only +2 ms: jitter, not a slowdown
    assert slowdown(short + [0.020, 0.020], cfg)["recent_ms"] == 20.0
    fr = [{"function": "write"}, {"function": "save_checkpoint"}, {"function": "main"}]
    assert expected_gap(fr, AutoConfig().expected_gap_words) == "save_checkpoint"
    assert expected_gap([{"function": "stuck_read"}], AutoConfig().expected_gap_words) is None
    assert AutoConfig.from_env("0") is None and AutoConfig.from_env("1") == AutoConfig()
    assert AutoConfig.from_env('{"gap_s": 7}').gap_s == 7


class _Tracker:
    """The agent's step tracker as the auto-trigger reads it: a step count and the seconds since
    the last step ended, set by the test."""

    def __init__(self) -> None:
        self.count, self.age, self.durations = 5, 0.0, []

    def seconds_since_boundary(self) -> float:
        return self.age

    def recent_ms(self, n: int) -> list[float]:
        return []


def test_a_stall_right_after_an_expected_gap_counts_from_its_end(tmp_path):
    """A checkpoint longer than gap_s, then the step it interrupted goes on: the step has not
    ended yet but the main thread is back in its own work. That is no stall (CI caught one such
    snapshot: a poll landed between the checkpoint's end and the step's); a real stall after the
    checkpoint is one gap_s after the checkpoint's end. Polls with given times, from this thread
    (the main thread), inside or outside a function named like a checkpoint."""
    tr = _Tracker()
    agent = SimpleNamespace(tracker=tr, driver=SimpleNamespace(holding_since=None, held_until=None, state="busy"))
    auto = AutoTrigger(agent, AutoConfig(out=str(tmp_path), gap_s=1.0, first_gap_factor=1.0,
                                         expected_gap_factor=10.0, min_interval_s=0.0))
    assert threading.current_thread() is threading.main_thread()
    here = next(t for t in thread_stacks() if t["thread_id"] == threading.main_thread().ident)["frames"]
    assert expected_gap(here, auto.cfg.expected_gap_words) is None  # this test's own frames name none

    def poll_inside_save_checkpoint(age: float, now: float) -> None:
        tr.age = age
        auto.poll(now)

    def poll(age: float, now: float) -> None:
        tr.age = age
        auto.poll(now)

    poll_inside_save_checkpoint(3.0, 100.0)  # 3 s into a checkpoint: expected, up to 10 s
    assert auto.snapshots == 0 and auto.events[-1]["action"] == "expected_gap"
    poll(3.1, 100.1)  # the checkpoint returned 0.1 s ago; the step goes on
    poll(3.9, 100.9)
    assert auto.snapshots == 0
    poll(4.2, 101.2)  # 1.2 s since the checkpoint's end and still no step: a stall
    assert auto.snapshots == 1
    meta = json.loads(next(tmp_path.glob("snap-*/rank*/meta.json")).read_text())
    assert meta["trigger"]["no_step_for_s"] == 1.2 and meta["trigger"]["expected_gap_function"] is None
    # a gap of another step with no checkpoint in it counts from that step's end
    tr.count = 6
    poll(1.5, 110.0)
    assert auto.snapshots == 2
