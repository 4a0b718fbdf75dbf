"""CUPTI PM sampling: the sampler process per capture (agent/pmsidecar.py) with real processes and
pipes, its sampler standing in for CUPTI's (tests/agent/pm_standin.py); where CUPTI cannot run
(this CPU machine, CI) the agent says why and falls back to NVML/GPM; request validation. The
GPU path itself is exercised by bench/pm_sidecar.sh and bench/pm_repeat.sh."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from aiprof.protocol import CaptureRequest, RequestError
from aiprof.agent.hwmon import HwSampler
from aiprof.agent.pmsampling import PmSampler, PmUnavailable
from aiprof.agent.pmsidecar import PmSidecar, SidecarError


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="this test is about machines without a GPU")
def test_pm_sampler_without_gpu_raises_one_line_reason():
    with pytest.raises(PmUnavailable) as ei:
        PmSampler(0, 100)
    msg = str(ei.value)
    assert msg and "\n" not in msg and "Traceback" not in msg


def test_pm_interval_outside_bounds_is_refused_before_any_cupti_call():
    with pytest.raises(PmUnavailable, match="outside"):
        PmSampler(0, 5)


def test_hw_sampler_without_cuda_device_says_so_once():
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=None)
    s.start()
    s.stop_pm()
    assert s._pm_ready.wait(10)
    samples = s.stop(timeout=10)
    assert s.pm_samples is None
    assert s.pm_status["asked"] and not s.pm_status["ok"]
    assert "no CUDA device" in s.pm_status["error"]
    # a CPU job: the sampler's own note says there is no GPU; PM adds no second one
    assert [n for n in s.notes if "CUDA" in n] == ["no CUDA device in use: GPU counters not sampled"]
    assert isinstance(samples, list)


@pytest.mark.skipif(_has_gpu(), reason="this test is about machines without a GPU")
def test_hw_sampler_pm_failure_on_a_cpu_machine_is_recorded_not_raised():
    # the real path: build (or find headers missing), load CUPTI, fail to initialise the profiler
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.profiler_ready.set()  # as the capture driver does after prepare_trace
    s.start()
    s._pm_ready.wait(120)  # first use may compile the C side
    s.stop(timeout=10)
    assert not s.pm_status["ok"] and s.pm_status["error"]
    assert "cupti-pm" not in s.sources
    assert any("PM sampling unavailable" in n and "NVML/GPM" in n for n in s.notes)


def test_hw_sampler_pm_off_asks_nothing():
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=0, cuda_index=0)
    s.start()
    s.stop(timeout=10)
    assert s.pm_status == {"asked": False, "ok": False}
    assert not any("PM sampling" in n for n in s.notes)


@pytest.mark.parametrize("us,ok", [(0, True), (20, True), (100, True), (100_000, True), (5, False), (-1, False),
                                   (100_001, False)])
def test_request_validates_pm_interval(us, ok):
    req = CaptureRequest(hw_pm_interval_us=us)
    if ok:
        assert req.normalised().hw_pm_interval_us == us
    else:
        with pytest.raises(RequestError, match="hw-pm-interval-us"):
            req.normalised()


def test_request_default_is_on_at_100_us_and_round_trips():
    assert CaptureRequest().normalised().hw_pm_interval_us == 100  # on by default (docs/capture.md)
    req = CaptureRequest(hw_pm_interval_us=0).normalised()
    assert CaptureRequest.from_dict(req.to_dict()).hw_pm_interval_us == 0


def test_cli_bad_pm_interval_is_one_line_error():
    r = subprocess.run([sys.executable, "-m", "aiprof", "run", "--iterations", "1", "--hw-pm-interval-us", "3", "--",
                        sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "hw-pm-interval-us" in r.stderr and "Traceback" not in r.stderr


class _RecordingNvml:
    """NVML as ``_Gpu`` uses it, on a machine without a GPU: every call is recorded (a GPM-capable
    GPU with NVLink field values), so the test sees what one reading asks the driver for."""

    NVML_CLOCK_SM = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRICS_GET_VERSION = 1

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        if not name.startswith("nvml"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            if name == "nvmlGpmQueryDeviceSupport":
                return type("S", (), {"isSupportedDevice": True})()
            if name == "nvmlDeviceGetFieldValues":
                v = type("V", (), {"nvmlReturn": 0, "value": type("U", (), {"ullVal": 1})()})
                return [v(), v()]
            if name in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetPowerUsage"):
                return 1000
            return type("R", (), {"gpu": 1, "memory": 1, "used": 1})()
        return call


def test_nvml_is_not_read_while_pm_samples():
    # NVML polled from the job's process while PM sampled made GPT-2 steps ×1.050 longer on an
    # H100, the GPU's kernels unchanged; read only around the PM session, ×0.997
    # (bench/pm_overhead.py): no NVML call at all while PM samples, every source otherwise
    from aiprof.agent.hwmon import _Gpu

    nvml = _RecordingNvml()
    gpu = _Gpu(nvml, object(), "gpu0")
    assert gpu.gpm_ids, "the recording NVML offers GPM"
    gpu.gpm_prev_t = 0.0  # the GPM window is long enough
    nvml.calls.clear()
    out: list = []
    gpu.sample(out, 0, pm_running=True)
    assert nvml.calls == [] and out == []
    gpu.sample(out, 0, pm_running=False)
    for call in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetClockInfo", "nvmlDeviceGetPowerUsage",
                 "nvmlDeviceGetMemoryInfo", "nvmlGpmSampleGet", "nvmlDeviceGetFieldValues"):
        assert call in nvml.calls
    assert {m for _, _, m, _ in out} >= {"gpu_util_pct", "sm_clock_mhz", "power_w", "mem_used_bytes"}


STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pm_standin.py")


class _StandIn:
    """The sampler process as tests drive it: the real child protocol with a sampler standing in
    for CUPTI's (pm_standin.py), a gate file its set-up waits for, and the log it writes."""

    def __init__(self, tmp_path, monkeypatch) -> None:
        self.gate = str(tmp_path / "gate")
        self.log = str(tmp_path / "standin.log")
        monkeypatch.setattr(PmSidecar, "command", [sys.executable, STANDIN])
        monkeypatch.setenv("STANDIN_LOG", self.log)
        monkeypatch.delenv("STANDIN_MODE", raising=False)
        monkeypatch.delenv("STANDIN_GATE", raising=False)
        self.monkeypatch = monkeypatch

    def gated(self) -> None:
        self.monkeypatch.setenv("STANDIN_GATE", self.gate)

    def open_gate(self) -> None:
        open(self.gate, "w").close()

    def mode(self, mode: str) -> None:
        self.monkeypatch.setenv("STANDIN_MODE", mode)

    def events(self, what: str) -> list[float]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [float(line.split()[1]) for line in f if line.startswith(what + " ")]


@pytest.fixture
def standin(tmp_path, monkeypatch):
    return _StandIn(tmp_path, monkeypatch)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sampler_process_samples_and_hands_its_rows_back(standin):
    side = PmSidecar("GPU-pretend", 3, 100)
    side.wait_ready(30)
    assert standin.events("entered") == []  # no CUPTI before "start" (the job's profiler first)
    assert side.device == 0  # its GPU is the only one it sees (CUDA_VISIBLE_DEVICES=<uuid>)
    side.start()
    assert side.columns == ["pm_sm_active_pct", "pm_dram_read_Bps"] and side.chip == "standin"
    got = side.stop()
    assert len(got.t0) == 1000 and got.values.shape == (1000, 2) and got.values.dtype.name == "float32"
    assert got.batches[-1]["row_end"] == 1000 and len(got.clock) == 2
    assert got.stats["sampler_process"]["pid"] == side.pid
    side.proc.wait(10)
    assert side.proc.returncode == 0 and not os.path.exists(side.dir)


def test_the_metrics_a_prewarm_resolved_reach_the_sampler(standin):
    side = PmSidecar(None, 0, 100, metrics={"pm_tensor_active_pct": "sm__pipe_tensor_cycles_active.avg.pct"})
    side.wait_ready(30)
    side.start()
    assert side.columns == ["pm_tensor_active_pct"]
    assert side.stop().metrics == ["sm__pipe_tensor_cycles_active.avg.pct"]


def test_a_sampler_process_that_crashes_is_one_line_and_the_job_goes_on(standin):
    standin.mode("crash")  # SIGSEGV inside the set-up, as a fault in CUPTI would
    side = PmSidecar(None, 0, 100)
    side.wait_ready(30)
    with pytest.raises(SidecarError) as ei:
        side.start()
    msg = str(ei.value)
    assert "ended before 'started'" in msg and "killed by signal 11" in msg and "\n" not in msg
    assert not os.path.exists(side.dir)


def test_a_sampler_process_that_never_answers_is_killed(standin):
    standin.mode("silent")
    side = PmSidecar(None, 0, 100)
    side.wait_ready(30)
    t0 = time.monotonic()
    with pytest.raises(SidecarError, match="gave no 'started' within 1 s"):
        side.start(timeout=1.0)
    assert time.monotonic() - t0 < 15
    assert not _alive(side.pid)


def test_a_sampler_failure_is_its_one_line_reason(standin):
    standin.mode("fail")
    side = PmSidecar(None, 0, 100)
    side.wait_ready(30)
    with pytest.raises(SidecarError, match="^stand-in: no PM sampling on this pretend GPU$"):
        side.start()


def test_a_sampler_process_ends_when_the_job_is_gone(standin):
    """The job's exit closes the child's stdin: a sampling child stops, leaves no rows behind
    (nobody would take them) and exits by itself."""
    side = PmSidecar(None, 0, 100)
    side.wait_ready(30)
    side.start()
    side.proc.stdin.close()  # what the job's death does to the pipe
    side.proc.wait(15)
    assert side.proc.returncode == 0 and not os.path.exists(side.dir)
    side.close()


def test_a_sampler_past_its_lifetime_stops_by_itself_and_keeps_its_rows(standin, monkeypatch):
    """No child outlives MAX_LIFETIME_S; one that stopped at it has written its rows, which the
    capture's stop still takes."""
    monkeypatch.setenv("STANDIN_LIFETIME", "5")  # the parent says "start" within ms of "ready"
    side = PmSidecar(None, 0, 100)
    side.wait_ready(30)
    side.start()
    side.proc.wait(30)  # it ends by itself, rows written
    got = side.stop()
    assert len(got.t0) == 1000


def test_every_capture_gets_a_sampler_process_of_its_own(standin):
    """CUPTI allows one PM session per process once Kineto has finalised it: each capture's
    samples come from a fresh process, however many captures came before."""
    pids = []
    for _ in range(3):
        s = HwSampler(interval_ms=50, gpu_uuids=["GPU-pretend"], pm_interval_us=100, cuda_index=0)
        s.profiler_ready.set()
        s.start()
        assert s._pm_ready.wait(30)
        s.stop(timeout=10)
        assert s.pm_status["ok"], s.pm_status
        assert s.pm_samples is not None and len(s.pm_samples.t0) == 1000
        pids.append(s.pm_status["sampler_pid"])
    assert len(set(pids)) == 3
    assert not any(_alive(p) for p in pids)


def test_a_capture_that_ends_during_the_set_up_kills_its_sampler(standin):
    """No wait at the capture's stop: the sampler process still setting up is killed (its CUPTI
    is its own, so nothing in the job can be left inside it), and never starts sampling."""
    standin.gated()
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.profiler_ready.set()
    s.start()
    _until(lambda: standin.events("entered"), "the sampler's set-up never began")
    pid = s._pm_pending.pid
    t0 = time.monotonic()
    s.stop_pm()
    assert time.monotonic() - t0 < 10
    assert s._pm_ready.wait(10)
    s.stop(timeout=10)
    assert not _alive(pid) and standin.events("started") == []
    assert not s.pm_status["ok"] and "the capture ended before PM sampling was set up" in s.pm_status["error"]


def test_a_set_up_waiting_for_the_profiler_is_released_by_stop(standin):
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.start()  # the profiler is never ready: the sampler process runs, but no CUPTI and no sampling
    _until(lambda: standin.events("spawned"), "the sampler process never ran")
    s.stop(timeout=10)
    assert s._pm_ready.wait(10)
    assert standin.events("entered") == [] and standin.events("started") == []
    assert not s.pm_status["ok"] and "the capture ended before PM sampling was set up" in s.pm_status["error"]


class _Job:
    """The agent as the capture driver sees it: the real step tracker, told of every iteration."""

    def __init__(self, driver_cls) -> None:
        from aiprof.agent.steps import StepTracker

        self.driver = driver_cls(self)
        self.tracker = StepTracker(self.driver)

    def step(self) -> int:
        """One iteration boundary, as the optimizer hook reports it; returns the new iteration."""
        t = self.tracker
        k = t.count
        t.count = k + 1
        t._ended(time.perf_counter())
        self.driver.step_end(k)
        self.driver.step_begin(k + 1)
        return k + 1


def _pm_job(tmp_path, **req_kw):
    """A driver armed for a capture with PM counters on a (pretend) CUDA device 0: CPU torch runs
    the real profiler; only the device index is set, as the stepping thread would read it."""
    from aiprof.agent.capture import ARMED, CaptureDriver

    job = _Job(CaptureDriver)
    job.driver.job_device = 0
    req = CaptureRequest(out=str(tmp_path), capture_id="pm", what="kernels,hw", hw_pm_interval_us=100,
                         iterations=2, **req_kw).normalised()
    assert job.driver.submit(req) is None and job.driver.state == ARMED
    job.driver.info["device"] = {"index": 0, "name": "pretend"}  # what _gpu_uuids reads from CUDA
    return job


def _until(cond, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)  # polling a background thread, bounded
    assert cond(), what


def test_recording_waits_for_the_pm_sampler_and_its_first_step_is_sampled(standin, tmp_path):
    """Skip-based capture: no profiler while the sampler's library and metrics resolve (their CUPTI
    calls and Kineto's set-up never overlap: that crashed 4-rank jobs); then the profiler is
    prepared and the sampler set up; the recording starts only once the sampler runs. The job's
    iterations go on meanwhile (the driver never blocks a step)."""
    from aiprof.agent.capture import ARMED, RECORDING

    standin.gated()
    job = _pm_job(tmp_path)
    d = job.driver
    for _ in range(5):  # the library and metrics are not resolved yet
        job.step()
    assert d.state == ARMED and not d.prepared and d.sampler is None
    d._pm_prewarmed.set()  # what the prewarm thread does when it has resolved them
    job.step()
    assert d.prepared and d.sampler is not None  # the profiler first, then the sampler's set-up
    _until(lambda: standin.events("entered"), "the sampler's set-up never began")
    for _ in range(3):  # the sampler is setting up: iterations go on, none recorded
        job.step()
    assert d.state == ARMED and d.steps == []
    standin.open_gate()
    _until(d.sampler.pm_settled, "the set-up never ended")
    k = job.step()
    assert d.state == RECORDING and d.steps == [k]
    started = standin.events("started")
    assert started and started[0] < d.t_start  # sampling began before the first recorded step
    job.step(), job.step()
    _until(lambda: d.state == "idle", "the capture never finished")
    assert d.last_result["ok"], d.last_result


def test_fixed_iterations_prepare_ahead_and_start_where_asked(standin, tmp_path):
    """A common start (``start_at``: every rank records the same iterations) is not moved: the
    profiler is prepared PM_SETUP_LEAD_S of iterations ahead, so the sampler is set up by then."""
    from aiprof.agent.capture import RECORDING
    from aiprof.protocol import PM_SETUP_LEAD_S

    job = _pm_job(tmp_path, start_at=70)
    d = job.driver
    d._pm_prewarmed.set()
    step_s = 0.025  # every iteration ~25 ms: the lead is ~PM_SETUP_LEAD_S / 25 ms iterations
    k = 0
    while not d.prepared:
        time.sleep(step_s)
        k = job.step()
    most = 1 + int(PM_SETUP_LEAD_S / step_s)  # the lead when iterations take exactly step_s (at least that)
    assert 70 - most <= k < 70 - 1  # earlier than the usual one iteration ahead, and not before the lead
    while job.tracker.count < 70:
        job.step()
    assert d.state == RECORDING and d.steps == [70]
    job.step(), job.step()
    _until(lambda: d.state == "idle", "the capture never finished")
    assert d.last_result["ok"], d.last_result


def test_a_sampler_whose_library_failed_records_without_pm_and_says_why(tmp_path):
    """The real prewarm on a machine without a GPU fails: the capture records without PM counters
    (no set-up under Kineto) and meta.json says why; later captures do not try again."""
    import json

    job = _pm_job(tmp_path)
    d = job.driver
    job.step()
    d.poll()  # the control thread starts the prewarm
    _until(d._pm_prewarmed.is_set, "the prewarm never ended", limit_s=120)  # the first use compiles the C side
    assert d.pm_prewarm_error and not d.pm_ready
    for _ in range(4):
        job.step()
    _until(lambda: d.state == "idle", "the capture never finished")
    assert d.last_result["ok"], d.last_result
    pm = json.load(open(os.path.join(d.last_result["dir"], "meta.json")))["hw"]["pm"]
    assert pm["asked"] and not pm["ok"] and "could not be set up" in pm["error"]


def test_trigger_leaves_room_for_the_pm_sampler_before_a_common_start():
    """`aiprof trigger`'s common start: half a second of iterations; with PM counters also the
    sampler's set-up, and its library and metrics where an agent has not resolved them yet."""
    from aiprof.agent.control import Endpoint
    from aiprof.attach.trigger import ALIGN_MARGIN_S, Agent, plan_requests
    from aiprof.protocol import PM_PREWARM_LEAD_S, PM_SETUP_LEAD_S

    def agents(ready: bool, off: tuple[bool, bool] = (False, False)) -> list:
        return [Agent(Endpoint(p, f"/x/{p}"), {"job": "j", "steps": 100, "step_ms": 10.0, "pm_ready": ready,
                                                "pm_off": o}) for p, o in zip((1, 2), off)]

    plain = CaptureRequest(what="kernels,hw", hw_pm_interval_us=0).normalised()
    pm = CaptureRequest(what="kernels,hw", hw_pm_interval_us=100).normalised()
    base = 100 + int(ALIGN_MARGIN_S * 1e3 / 10)
    assert {r.start_at for r in plan_requests(agents(True), plain).values()} == {base}
    assert {r.start_at for r in plan_requests(agents(True), pm).values()} == {base + int(PM_SETUP_LEAD_S * 1e3 / 10)}
    assert {r.start_at for r in plan_requests(agents(False), pm).values()} == {
        base + int((PM_SETUP_LEAD_S + PM_PREWARM_LEAD_S) * 1e3 / 10)}
    # agents that will not sample (CPU jobs, or PM failed there for good) need no room at all, and
    # one of them beside a ready agent adds no prewarm lead
    assert {r.start_at for r in plan_requests(agents(False, (True, True)), pm).values()} == {base}
    assert {r.start_at for r in plan_requests(agents(False, (True, False)), pm).values()} == {
        base + int((PM_SETUP_LEAD_S + PM_PREWARM_LEAD_S) * 1e3 / 10)}
    mixed = agents(True, (True, False))
    mixed[0].status["pm_ready"] = False  # the off agent never resolves metrics; the other has
    assert {r.start_at for r in plan_requests(mixed, pm).values()} == {base + int(PM_SETUP_LEAD_S * 1e3 / 10)}


@pytest.mark.skipif(_has_gpu(), reason="a CUDA job: this checks a CPU process")
def test_an_agent_says_when_it_will_not_sample_pm():
    """``pm_off``: no CUDA in use in the process (this CPU job), or a lasting PM failure."""
    from aiprof.agent.capture import CaptureDriver

    job = _Job(CaptureDriver)
    d = job.driver
    assert not d.pm_off  # no iteration yet: a GPU job may not have touched CUDA so far
    job.step()
    assert d.pm_off  # iterations ran, CUDA never initialised: a CPU job
    d.job_device = 0
    assert not d.pm_off
    d.pm_lasting_error = "cuptiPmSamplingEnable: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"
    assert d.pm_off


@pytest.mark.parametrize("msg,lasts", [
    ("PM sampling start: cuptiPmSamplingEnable: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES", True),
    ("CUPTI: CUPTI_ERROR_NOT_SUPPORTED", True),
    ("no CUDA driver (libcuda.so.1: cannot open shared object file)", True),
    ("cuInit failed (CUresult 100)", True),  # no device
    ("cuInit failed (CUresult 999)", False),
    ("the PM sampler process gave no 'started' within 30 s (exit 1): CUPTI_ERROR_NOT_SUPPORTEDX", False),
    ("the PM sampler process gave no answer within 15 s", False),
    ("cuptiPmSamplingGetCounterAvailability: CUPTI_ERROR_UNKNOWN", False),
])
def test_which_pm_failures_last(msg, lasts):
    from aiprof.agent.hwmon import pm_failure_lasts

    assert pm_failure_lasts(msg) is lasts


@pytest.mark.skipif(_has_gpu(), reason="needs the sampler to fail for want of a CUDA driver")
def test_a_lasting_sampler_failure_is_not_retried_by_later_captures(tmp_path):
    """The real sampler process on this machine without a GPU fails ("no CUDA driver"), a failure
    every later capture would meet: the first capture says it; the second starts no sampler
    process and says why, and both record without PM counters."""
    import json

    from aiprof.agent.capture import ARMED

    job = _pm_job(tmp_path)
    d = job.driver
    d._pm_prewarmed.set()  # as if the library and metrics had resolved
    for _ in range(6):
        job.step()
        if d.state == ARMED and d.sampler is not None:
            _until(d.sampler.pm_settled, "the sampler's set-up never ended", limit_s=60)
    _until(lambda: d.state == "idle", "the first capture never finished")
    first = json.load(open(os.path.join(d.last_result["dir"], "meta.json")))["hw"]["pm"]
    assert first["asked"] and not first["ok"] and first.get("lasting"), first
    assert first["error"].startswith(("no CUDA driver", "cuInit failed")) and d.pm_lasting_error and d.pm_off
    req = CaptureRequest(out=str(tmp_path), capture_id="pm2", what="kernels,hw", hw_pm_interval_us=100,
                         iterations=2).normalised()
    assert d.submit(req) is None
    d.info["device"] = {"index": 0, "name": "pretend"}  # what _gpu_uuids reads from CUDA
    for _ in range(4):
        job.step()
    _until(lambda: d.state == "idle", "the second capture never finished")
    assert d.last_result["ok"], d.last_result
    second = json.load(open(os.path.join(d.last_result["dir"], "meta.json")))["hw"]["pm"]
    assert not second["ok"] and "failed in an earlier capture" in second["error"], second
    assert "sampler_pid" not in second


def test_a_job_that_ends_while_its_capture_waits_for_the_sampler_says_so(tmp_path, capsys):
    """PM is on by default: a short GPU job can end while its capture, past --skip, still waits
    for the sampler (the first on a machine compiles for ~10 s). The agent says so at exit,
    with the option that records at once; a capture not yet reached says nothing."""
    from aiprof.agent import log
    from aiprof.agent.capture import ARMED

    log._seen.discard("pm-wait-exit")
    job = _pm_job(tmp_path, skip=5)
    d = job.driver
    job.step()
    d.at_exit()  # before --skip is reached: fewer iterations ran, as `aiprof run` says itself
    assert "waited" not in capsys.readouterr().err
    for _ in range(8):  # past --skip, the library and metrics never resolved
        job.step()
    assert d.state == ARMED and d.steps == []
    d.at_exit()
    err = capsys.readouterr().err
    assert "waited" in err and "GPU counters' sampler" in err and "--hw-pm-interval-us 0" in err
