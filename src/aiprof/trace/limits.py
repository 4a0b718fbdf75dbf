"""Bounds on what reading one trace may cost, since a trace may be someone else's file (the
service analyses what agents upload): memory grows with the JSON inflated and the events
decoded, not with the size of the file on disk, so a few MB of gzip can hold GBs of events.

Each bound has a default, an environment variable and (on the verbs that read traces) a CLI
option that sets that variable, so that the processes a reader starts (ingest workers, Ray,
the service's ``aiprof analyze`` child) inherit it. Going past a bound is a one-line
:class:`TraceError` that names the bound and how to raise it; nothing is written.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from aiprof.errors import TraceError, UsageError

# JSON inflated from one trace. The agent keeps a trace.json.gz of up to 512 MB (--max-trace-mb)
# and Kineto's JSON gzips 10-15x (tests/data), so 8 GiB reads every trace the agent keeps;
# analysis then peaks at a few times that in memory: lower it on a small host that analyses
# uploads.
DEFAULT_MAX_TRACE_GB = 8.0
ENV_MAX_TRACE_GB = "AIPROF_MAX_TRACE_GB"
# Events of one trace: each costs ~100-200 bytes of columns plus its names, so 40 M is a few GB
# of tables; indented Kineto JSON is ~300-500 bytes an event, so 8 GiB holds fewer than this.
DEFAULT_MAX_EVENTS = 40_000_000
ENV_MAX_EVENTS = "AIPROF_MAX_EVENTS"
# Inflated/compressed size of a gzip trace. Kineto's JSON gzips 10-15x, a stream of one repeated
# event up to deflate's ~1000x: a file past 100x is a bomb, refused after the first
# GZIP_RATIO_AFTER_BYTES of JSON (below that a small repetitive test trace may be anything).
DEFAULT_MAX_GZIP_RATIO = 100.0
ENV_MAX_GZIP_RATIO = "AIPROF_MAX_GZIP_RATIO"
GZIP_RATIO_AFTER_BYTES = 64 << 20


@dataclass(frozen=True)
class Limits:
    max_gb: float
    max_events: int
    max_ratio: float

    @property
    def max_bytes(self) -> int:
        return int(self.max_gb * (1 << 30))

    def too_big(self, path: str, inflated: bool) -> TraceError:
        verb = "decompresses to" if inflated else "is"
        return TraceError(path, f"{verb} more than {_num(self.max_gb)} GiB of JSON, the limit on one trace "
                                f"(--max-trace-gb or ${ENV_MAX_TRACE_GB} raises it)")

    def too_many(self, path: str) -> TraceError:
        return TraceError(path, f"more than {self.max_events:,} events, the limit on one trace "
                                f"(--max-events or ${ENV_MAX_EVENTS} raises it)")

    def bomb(self, path: str, ratio: float) -> TraceError:
        return TraceError(path, f"gzip inflates {ratio:.0f}x, past the limit of {_num(self.max_ratio)}x for a trace "
                                f"(a decompression bomb? ${ENV_MAX_GZIP_RATIO} raises it)")


def _num(x: float) -> str:
    return f"{x:g}"


def _env_number(name: str, default: float, integer: bool = False) -> float:
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        v = int(raw) if integer else float(raw)
    except ValueError:
        raise UsageError(f"${name}={raw!r} is not a number") from None
    if not v > 0:
        raise UsageError(f"${name}={raw!r} must be > 0")
    return v


def current() -> Limits:
    """The bounds in force: the environment's, else the defaults (a bad value: UsageError)."""
    return Limits(max_gb=_env_number(ENV_MAX_TRACE_GB, DEFAULT_MAX_TRACE_GB),
                  max_events=int(_env_number(ENV_MAX_EVENTS, DEFAULT_MAX_EVENTS, integer=True)),
                  max_ratio=_env_number(ENV_MAX_GZIP_RATIO, DEFAULT_MAX_GZIP_RATIO))


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """``--max-trace-gb`` / ``--max-events`` on a verb that reads traces."""
    p.add_argument("--max-trace-gb", type=float, default=None, metavar="GB",
                   help=f"refuse a trace of more JSON than this, once inflated (default ${ENV_MAX_TRACE_GB} "
                        f"or {_num(DEFAULT_MAX_TRACE_GB)})")
    p.add_argument("--max-events", type=int, default=None, metavar="N",
                   help=f"refuse a trace of more events than this (default ${ENV_MAX_EVENTS} or {DEFAULT_MAX_EVENTS:,})")


def apply_limit_options(args: argparse.Namespace) -> None:
    """Put the options into the environment, where this process's readers and its children find them."""
    for opt, env, val in (("--max-trace-gb", ENV_MAX_TRACE_GB, getattr(args, "max_trace_gb", None)),
                          ("--max-events", ENV_MAX_EVENTS, getattr(args, "max_events", None))):
        if val is None:
            continue
        if not val > 0:
            raise UsageError(f"{opt} must be > 0, not {val}")
        os.environ[env] = str(val)
    current()  # a bad value already in the environment: say so now, not mid-ingest
