"""A PM sampler process whose sampler stands in for CUPTI's (which needs a GPU): the real
pmsidecar protocol, pipes and rows file, with the stand-in's behaviour chosen by environment:

- ``STANDIN_MODE``: ``ok`` (default), ``crash`` (SIGSEGV in the set-up, as a fault in CUPTI
  would), ``silent`` (never answers), ``fail`` (a PmUnavailable with a one-line reason);
- ``STANDIN_LIFETIME``: seconds the child lives (pmsidecar.MAX_LIFETIME_S);
- ``STANDIN_GATE``: a path the set-up waits for (bounded) before it is ready;
- ``STANDIN_LOG``: a file that gets ``spawned <monotonic>`` when the process runs, ``entered``
  when the sampler's set-up begins (the parent said "start"), ``left`` when it is over and
  ``started`` when sampling starts (CLOCK_MONOTONIC is one clock for all processes).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from aiprof.agent import pmsidecar
from aiprof.agent.pmsampling import PmSamples, PmUnavailable

ROWS = 1000
PERIOD_NS = 100_000


def _log(what: str) -> None:
    path = os.environ.get("STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {time.monotonic()}\n")


class StandIn:
    def __init__(self, device: int, interval_us: int, metrics: dict | None = None) -> None:
        _log("entered")
        mode = os.environ.get("STANDIN_MODE", "ok")
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if mode == "silent":
            time.sleep(600)
        if mode == "fail":
            raise PmUnavailable("stand-in: no PM sampling on this pretend GPU")
        gate = os.environ.get("STANDIN_GATE")
        deadline = time.monotonic() + 30
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)  # waiting for the test's gate file, bounded
        _log("left")
        self.device, self.interval_us = device, interval_us
        self.metrics = metrics or {"pm_sm_active_pct": "sm__cycles_active.avg.pct_of_peak_sustained_elapsed",
                                   "pm_dram_read_Bps": "dram__bytes_read.sum"}
        self.columns = list(self.metrics)
        self.chip, self.timing_ms, self.reset = "standin", {"configure": 1.0}, None

    def start(self) -> None:
        print("a library's line on stdout")  # (CUPTI may print): it must not break the protocol
        _log("started")
        self.c0, self.u0 = 10**12, time.time_ns()

    def stop(self) -> PmSamples:
        t0 = (self.c0 + np.arange(ROWS, dtype=np.uint64) * PERIOD_NS).astype(np.uint64)
        vals = np.column_stack([np.linspace(0, 100, ROWS), np.full(ROWS, 32.0)]).astype(np.float32)
        end = int(t0[-1]) + PERIOD_NS
        clock = [{"cupti_ns": self.c0, "unix_ns": self.u0, "bracket_ns": 100},
                 {"cupti_ns": end, "unix_ns": self.u0 + end - self.c0, "bracket_ns": 100}]
        batches = [{"row_end": ROWS, "cupti_ns": end, "unix_ns": self.u0 + end - self.c0}]
        return PmSamples(self.device, self.columns, [self.metrics[c] for c in self.columns], t0,
                         t0 + PERIOD_NS, vals, clock, batches, {"dropped": 0, "interval_us": self.interval_us})


if __name__ == "__main__":
    _log("spawned")
    if os.environ.get("STANDIN_LIFETIME"):  # a shorter life than the real MAX_LIFETIME_S, to see its end
        pmsidecar.MAX_LIFETIME_S = float(os.environ["STANDIN_LIFETIME"])
    ap_args = pmsidecar.parse_args(sys.argv[1:])
    sys.exit(pmsidecar.serve(ap_args, sys.stdin.fileno(), pmsidecar.protocol_stdout(), sampler_cls=StandIn))
