"""CUPTI PM sampling: where it cannot run (this CPU machine, CI), the agent says why and falls back
to NVML/GPM; request validation. The GPU path itself is exercised by bench/pm_probe.py."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import ClassVar

import pytest

from aiprof.protocol import CaptureRequest, RequestError
from aiprof.agent.hwmon import HwSampler, pm_refused
from aiprof.agent.pmsampling import PmSampler, PmUnavailable


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
    s.stop_pm(timeout=10)
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


def test_pm_setup_waiting_for_the_profiler_is_released_by_stop():
    # a capture that fails before the profiler is prepared: the setup gives up, no CUPTI call
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.start()
    s.stop(timeout=10)
    assert s._pm_ready.wait(10)
    assert not s.pm_status["ok"] and "before the profiler was ready" in s.pm_status["error"]


@pytest.mark.parametrize("env", [{}, {"LOCAL_RANK": "0"}, {"LOCAL_RANK": "1"}, {"LOCAL_RANK": "3"}])
def test_every_local_rank_samples(env):
    assert pm_refused(env, sessions=0) is None


def test_one_pm_session_per_process():
    assert pm_refused({}, sessions=0) is None
    assert "one PM session per process" in pm_refused({}, sessions=1)
    assert pm_refused({"AIPROF_PM_REPEAT": "1"}, sessions=3) is None


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


def test_request_default_is_off_and_round_trips():
    assert CaptureRequest().normalised().hw_pm_interval_us == 0  # experimental: only when asked for
    req = CaptureRequest(hw_pm_interval_us=100).normalised()
    assert CaptureRequest.from_dict(req.to_dict()).hw_pm_interval_us == 100


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


def test_gpm_and_nvlink_reads_pause_while_pm_samples():
    # PM sampling measures SM, tensor, DRAM, NVLink and PCIe every 100 µs: the 100 ms GPM and
    # NVLink field reads (2-2.5 ms of driver time each on an H200) are not taken twice
    from aiprof.agent.hwmon import _Gpu

    nvml = _RecordingNvml()
    gpu = _Gpu(nvml, object(), "gpu0")
    assert gpu.gpm_ids, "the recording NVML offers GPM"
    gpu.gpm_prev_t = 0.0  # the GPM window is long enough
    nvml.calls.clear()
    gpu.sample([], 0, pm_running=True)
    assert "nvmlGpmSampleGet" not in nvml.calls and "nvmlDeviceGetFieldValues" not in nvml.calls
    assert "nvmlDeviceGetUtilizationRates" in nvml.calls and "nvmlDeviceGetPowerUsage" in nvml.calls
    nvml.calls.clear()
    gpu.sample([], 0, pm_running=False)
    assert "nvmlGpmSampleGet" in nvml.calls and "nvmlDeviceGetFieldValues" in nvml.calls


class _SlowSetup:
    """Stands in for PmSampler where CUPTI cannot run (no GPU): its set-up stays "inside CUPTI"
    for ``hold_s`` (an H100 configures in ~0.6 s), or until ``gate`` opens when one is given; it
    records when it left and whether it was started."""

    hold_s = 0.5
    gate: threading.Event | None = None
    left: ClassVar[list] = []
    started: ClassVar[list] = []

    def __init__(self, device: int, interval_us: int) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        else:
            time.sleep(self.hold_s)
        _SlowSetup.left.append(time.monotonic())
        self.columns, self.metrics, self.chip, self.timing_ms = [], {}, "", {}

    def start(self) -> None:
        _SlowSetup.started.append(self)


def _entered_cupti(s: HwSampler) -> None:
    deadline = time.monotonic() + 10
    while s._pm_idle.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)  # polling for the set-up thread, bounded
    assert not s._pm_idle.is_set(), "the set-up never began"


@pytest.fixture
def slow_setup(monkeypatch):
    import aiprof.agent.pmsampling as pms

    from aiprof.agent import hwmon

    monkeypatch.setattr(pms, "PmSampler", _SlowSetup)
    monkeypatch.setattr(hwmon, "_PM_SESSIONS", 0)  # a stand-in that starts counts as a session
    monkeypatch.setattr(_SlowSetup, "started", [])
    monkeypatch.setattr(_SlowSetup, "left", [])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return _SlowSetup


def test_a_capture_that_ends_during_the_set_up_waits_for_it_to_leave_cupti(slow_setup):
    """The profiler's stop finalises CUPTI; under a set-up still configuring it, that crashed the
    job (SIGSEGV, 2 H100s): stop_pm cancels the set-up, waits until it is out of CUPTI, and only
    then says CUPTI is free. The cancelled set-up never starts sampling."""
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.profiler_ready.set()
    s.start()
    _entered_cupti(s)
    assert s.stop_pm() is True
    returned = time.monotonic()
    # it returned only once the set-up had left CUPTI (race-free: it never fails when it waits)
    assert s._pm_idle.is_set() and slow_setup.left and slow_setup.left[0] <= returned
    assert s._pm_ready.wait(10)
    s.stop(timeout=10)
    assert slow_setup.started == [] and not s.pm_status["ok"]
    assert "the capture ended before PM sampling was set up" in s.pm_status["error"]


def test_a_set_up_stuck_in_cupti_keeps_cupti_attached(slow_setup, monkeypatch):
    """Past PM_BUSY_WAIT_S the stop goes on without tearing CUPTI down (stop_pm says False, and
    cupti_teardown.keep takes our TEARDOWN_CUPTI back), with a note."""
    from aiprof.agent import cupti_teardown, hwmon

    monkeypatch.setattr(hwmon, "PM_BUSY_WAIT_S", 0.05)
    gate = threading.Event()  # the set-up stays inside until the test lets it go
    monkeypatch.setattr(slow_setup, "gate", gate)
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.profiler_ready.set()
    s.start()
    _entered_cupti(s)
    assert s.stop_pm() is False
    assert any("still inside CUPTI" in n for n in s.notes)
    monkeypatch.delenv(cupti_teardown.ENV, raising=False)
    assert cupti_teardown.decide()["teardown"] is True  # as an earlier capture set it
    kept = cupti_teardown.keep("the PM sampler's set-up was still inside CUPTI")
    assert kept["teardown"] is False and cupti_teardown.ENV not in os.environ
    gate.set()
    assert s._pm_ready.wait(10)
    s.stop(timeout=10)
    assert slow_setup.started == []


def test_a_stop_before_the_set_up_enters_cupti_does_not_wait(slow_setup):
    s = HwSampler(interval_ms=50, gpu_uuids=[], pm_interval_us=100, cuda_index=0)
    s.start()  # the profiler is never ready: the set-up waits outside CUPTI
    assert s.stop_pm() is True and "stop_waited_ms" not in s.pm_status
    assert s._pm_ready.wait(10)
    s.stop(timeout=10)
    assert slow_setup.started == [] and "before the profiler was ready" in s.pm_status["error"]


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


def test_recording_waits_for_the_pm_sampler_and_its_first_step_is_sampled(slow_setup, tmp_path, monkeypatch):
    """Skip-based capture: no profiler while the sampler's library and metrics resolve (their CUPTI
    calls and Kineto's set-up never overlap: that crashed 4-rank jobs); then the profiler is
    prepared and the sampler set up; the recording starts only once the sampler runs. The job's
    iterations go on meanwhile (the driver never blocks a step)."""
    from aiprof.agent.capture import ARMED, RECORDING

    gate = threading.Event()
    monkeypatch.setattr(slow_setup, "gate", gate)
    job = _pm_job(tmp_path)
    d = job.driver
    for _ in range(5):  # the library and metrics are not resolved yet
        job.step()
    assert d.state == ARMED and not d.prepared and d.sampler is None
    d._pm_prewarmed.set()  # what the prewarm thread does when it has resolved them
    job.step()
    assert d.prepared and d.sampler is not None  # the profiler first, then the sampler's set-up
    _entered_cupti(d.sampler)
    for _ in range(3):  # the set-up is inside CUPTI: iterations go on, none recorded
        job.step()
    assert d.state == ARMED and d.steps == []
    gate.set()
    _until(d.sampler.pm_settled, "the set-up never ended")
    k = job.step()
    assert d.state == RECORDING and d.steps == [k]
    assert slow_setup.started and slow_setup.left[0] < d.t_start  # sampling began before the first recorded step
    job.step(), job.step()
    _until(lambda: d.state == "idle", "the capture never finished")
    assert d.last_result["ok"], d.last_result


def test_fixed_iterations_prepare_ahead_and_start_where_asked(slow_setup, tmp_path):
    """A common start (``start_at``: every rank records the same iterations) is not moved: the
    profiler is prepared PM_SETUP_LEAD_S of iterations ahead, so the sampler is set up by then."""
    from aiprof.agent.capture import RECORDING
    from aiprof.protocol import PM_SETUP_LEAD_S

    slow_setup.hold_s = 0.0
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

    def agents(ready: bool) -> list:
        return [Agent(Endpoint(p, f"/x/{p}"), {"job": "j", "steps": 100, "step_ms": 10.0, "pm_ready": ready})
                for p in (1, 2)]

    plain = CaptureRequest(what="kernels,hw").normalised()
    pm = CaptureRequest(what="kernels,hw", hw_pm_interval_us=100).normalised()
    base = 100 + int(ALIGN_MARGIN_S * 1e3 / 10)
    assert {r.start_at for r in plan_requests(agents(True), plain).values()} == {base}
    assert {r.start_at for r in plan_requests(agents(True), pm).values()} == {base + int(PM_SETUP_LEAD_S * 1e3 / 10)}
    assert {r.start_at for r in plan_requests(agents(False), pm).values()} == {
        base + int((PM_SETUP_LEAD_S + PM_PREWARM_LEAD_S) * 1e3 / 10)}
