"""The agent detaches CUPTI at a CUDA capture's stop (TEARDOWN_CUPTI=1) unless the job set the
variable itself or uses CUDA graphs (agent/cupti_teardown.py)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from aiprof.agent import cupti_teardown as ct


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(ct.ENV, raising=False)
    monkeypatch.setattr(ct, "_state", {"ours": False, "graphs": False, "hooked": False})
    orig = torch.cuda.graphs.CUDAGraph.capture_begin
    yield
    torch.cuda.graphs.CUDAGraph.capture_begin = orig


def test_sets_it_when_the_job_did_not(monkeypatch):
    d = ct.decide()
    assert d["teardown"] is True and ct.os.environ[ct.ENV] == "1"
    assert ct.decide()["teardown"] is True  # a second capture: still ours, still set


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_jobs_own_setting_wins(monkeypatch, value):
    monkeypatch.setenv(ct.ENV, value)
    d = ct.decide()
    assert d["teardown"] is (value == "1") and "set by the job" in d["why"]
    assert ct.os.environ[ct.ENV] == value


def test_a_graph_engine_rules_it_out_and_takes_back_an_earlier_setting(monkeypatch):
    assert ct.decide()["teardown"] is True
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    d = ct.decide()
    assert d["teardown"] is False and "vllm" in d["why"] and ct.ENV not in ct.os.environ


def test_a_captured_cuda_graph_is_seen_through_the_real_class():
    ct.watch_graphs()
    ct.watch_graphs()  # idempotent: one wrapper
    assert ct.decide()["teardown"] is True  # nothing captured yet
    # no GPU here (CUDAGraph cannot even be made): the real capture_begin fails on a stand-in,
    # after the wrapper has noted the capture
    with pytest.raises(Exception):
        torch.cuda.graphs.CUDAGraph.capture_begin(object())
    d = ct.decide()
    assert d["teardown"] is False and "captured a CUDA graph" in d["why"]


def test_inductor_cudagraphs_rule_it_out():
    import torch._inductor.config as cfg

    # inductor's own patch (monkeypatch's undo deleted the setting: torch.profiler's
    # prepare_trace, which reads it, then failed in every later test of the process)
    with cfg.patch({"triton.cudagraphs": True}):
        d = ct.decide()
    assert d["teardown"] is False and "inductor" in d["why"]
    assert cfg.triton.cudagraphs is False


def test_finalize_waits_for_the_thread_the_finish_started_not_for_the_jobs(monkeypatch):
    import threading
    import time

    called = threading.Event()
    monkeypatch.setattr(ct, "_runtime_call", lambda dev: called.set())
    gone, stay, started = threading.Event(), threading.Event(), threading.Event()
    job_gone = threading.Thread(target=gone.wait, args=(10,))  # a job thread there before
    job_gone.start()
    job_new = threading.Thread(target=lambda: started.set() or stay.wait(10))  # one the job starts meanwhile
    out: dict = {}

    def finisher() -> None:  # the export thread: it finishes the profiler, Kineto starts a thread
        before = ct.threads_now()
        # Kineto's teardown thread: started by the finish, exits a while after the first CUDA call
        out["teardown"] = threading.Thread(target=lambda: called.wait(10) and time.sleep(0.3))
        out["teardown"].start()
        out["ready"].set()
        started.wait(10)  # the job started its thread and ended the other: the count is unchanged
        out["finalize"] = ct.finalize(0, before)

    out["ready"] = threading.Event()
    f = threading.Thread(target=finisher)
    f.start()
    try:
        out["ready"].wait(10)
        gone.set()
        job_gone.join()
        job_new.start()  # from this thread: not named after the finisher
        f.join(20)
        res = out["finalize"]
        # done once Kineto's thread is gone, though the job's new thread runs on
        assert res["done"] and res["threads"] >= 1 and not out["teardown"].is_alive(), res
        assert job_new.is_alive() and res["calls"] >= 2  # it kept calling while the teardown thread ran
    finally:
        stay.set()
        gone.set()


def test_finalize_gives_up_at_its_bound(monkeypatch):
    import threading

    monkeypatch.setattr(ct, "FINALIZE_WAIT_S", 0.2)
    monkeypatch.setattr(ct, "_runtime_call", lambda dev: None)
    stuck = threading.Event()
    out: dict = {}

    def finisher() -> None:  # a teardown thread that never ends (its CUDA call never comes)
        before = ct.threads_now()
        threading.Thread(target=stuck.wait, args=(10,)).start()
        out["finalize"] = ct.finalize(0, before)

    f = threading.Thread(target=finisher)
    f.start()
    try:
        f.join(20)
        res = out["finalize"]
        assert not res["done"] and res["threads"] >= 1 and res["ms"] >= 150  # it waited its bound out
    finally:
        stuck.set()


def test_the_jobs_own_teardown_is_finalized_too(monkeypatch):
    monkeypatch.setenv(ct.ENV, "1")  # set by the job: Kineto's thread waits all the same
    assert ct.pending()
    monkeypatch.setenv(ct.ENV, "0")
    assert not ct.pending()
