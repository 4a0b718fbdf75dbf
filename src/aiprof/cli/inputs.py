"""The trace-input option shared by the verbs that read traces (analyze, diff, flame, export, ui)."""
from __future__ import annotations

import argparse

from aiprof.trace.limits import add_limit_options


def add_capture_option(p: argparse.ArgumentParser) -> None:
    """``--capture N``: which of several captures of one process to read (default: the newest); and
    the bounds on one trace (``--max-trace-gb``, ``--max-events``: aiprof.trace.limits)."""
    p.add_argument("--capture", type=int, metavar="N",
                   help="when a folder holds several captures of one process (torch.profiler "
                        "tensorboard_trace_handler cycles), read the N-th (1 = the oldest; default: the newest)")
    add_limit_options(p)
