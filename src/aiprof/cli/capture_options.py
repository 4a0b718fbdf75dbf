"""Capture options shared by ``aiprof run``, ``attach`` and ``trigger``."""
from __future__ import annotations

import argparse
import os

from aiprof.protocol import (DEFAULT_DURATION_MS, DEFAULT_HW_PM_INTERVAL_US, DEFAULT_WHAT, NATIVE_LEVELS,
                             WHAT_LEVELS, CaptureRequest, RequestError, new_capture_id)
from aiprof.errors import UsageError


def add_capture_options(p: argparse.ArgumentParser, wait_default: int | None) -> None:
    """Add --skip/--iterations/--duration-ms/--what/--out/... to a verb's parser."""
    g = p.add_argument_group("capture")
    g.add_argument("--skip", type=int, default=None, metavar="N", help="iterations to let pass before recording (default 0)")
    g.add_argument("--iterations", "-n", type=int, default=None, metavar="M", help="iterations to record (default 3)")
    g.add_argument("--duration-ms", type=int, default=None, metavar="D",
                   help="record D ms instead (at iteration boundaries if iterations run, else on the main thread; "
                        "default: --iterations)")
    g.add_argument("--what", default=None, metavar="LEVELS",
                   help=f"comma list of {','.join(WHAT_LEVELS)} or all, plus {','.join(NATIVE_LEVELS)} (native "
                        f"sidecar, never in all; docs/capture.md) (default {','.join(DEFAULT_WHAT)})")
    g.add_argument("--entry", default=None, metavar="MODULE:QUALNAME",
                   help="count calls of this function as iterations (e.g. __main__:train_step, "
                        "vllm.engine.llm_engine:LLMEngine.step; default: optimizer steps)")
    g.add_argument("--out", default="aiprof-captures", metavar="DIR", help="captures go to DIR/<capture-id>/rank<R>/ (default aiprof-captures)")
    g.add_argument("--capture-id", default=None, metavar="ID",
                   help="name of the capture folder (default: time + random)")
    # one default per option: the fallback's own length is --duration-ms's business (or 2000 ms)
    g.add_argument("--wait-ms", type=int, default=wait_default, metavar="MS",
                   help=f"if no iteration is seen for MS, record --duration-ms (or {DEFAULT_DURATION_MS} ms) on the "
                        f"main thread (default " + ("none: wait for iterations" if wait_default is None
                                                    else str(wait_default)) + ")")
    g.add_argument("--hw-interval-ms", type=int, default=100, metavar="MS", help="hardware sample period (default 100)")
    g.add_argument("--hw-pm-interval-us", type=int, default=DEFAULT_HW_PM_INTERVAL_US, metavar="US",
                   help="GPU performance-monitor (CUPTI PM sampling) period under --what hw, e.g. 100; "
                        f"0 = off (default {DEFAULT_HW_PM_INTERVAL_US}; NVML/GPM only where it cannot run: docs/capture.md)")
    g.add_argument("--max-trace-mb", type=int, default=512, metavar="MB", help="largest trace.json.gz kept (default 512)")
    g.add_argument("--no-warmup", action="store_true", help="do not prepare the profiler one iteration early (default: prepare)")
    g.add_argument("--probe-file", default=None, metavar="FILE",
                   help="trace the library calls a probe file lists (JSON, docs/capture.md), through Frida; "
                        "'default' is a built-in one: NCCL collectives/groups/communicators and CUDA memory/sync "
                        "calls")
    g.add_argument("--syscall-interval-ms", type=float, default=2.0, metavar="MS",
                   help="sampling period of --what syscalls (default 2)")


def has_capture_options(args: argparse.Namespace) -> bool:
    """True if the user asked for a capture (any of skip/iterations/duration)."""
    return any(getattr(args, k) is not None for k in ("skip", "iterations", "duration_ms"))


def request_from_args(args: argparse.Namespace) -> CaptureRequest:
    """Build a validated CaptureRequest from parsed options (out made absolute)."""
    probes = None
    if getattr(args, "probe_file", None):
        from aiprof.native.probes import load_probe_file

        probes = load_probe_file(args.probe_file).to_dict()  # a bad file: one-line UsageError
    try:
        return CaptureRequest(
            out=os.path.abspath(args.out), capture_id=args.capture_id or new_capture_id(),
            what=args.what, skip=args.skip or 0, iterations=args.iterations, duration_ms=args.duration_ms,
            wait_ms=args.wait_ms, warmup=not args.no_warmup, hw_interval_ms=args.hw_interval_ms,
            hw_pm_interval_us=args.hw_pm_interval_us,
            max_trace_mb=args.max_trace_mb, entry=args.entry, probes=probes,
            syscall_interval_ms=getattr(args, "syscall_interval_ms", 2.0),
        ).normalised()
    except RequestError as exc:
        raise UsageError(str(exc)) from exc
