"""`aiprof` command line: one module per verb, each with `register(subparsers)` and `run(args)`.

Verbs stay thin: they parse arguments and call the library.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from aiprof import __version__
from aiprof.errors import AiprofError

# verb name -> module under aiprof.cli; a module that fails to import (optional extra missing)
# hides only its own verb.
VERBS = ["analyze", "diff", "run", "attach", "trigger", "stacks", "hang", "flame", "export", "ui", "server", "upload"]


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available verb."""
    parser = argparse.ArgumentParser(
        prog="aiprof",
        description="Why is my PyTorch job slow, stuck or wasteful? Capture, analyse, show.",
    )
    parser.add_argument("--version", action="version", version=f"aiprof {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb in VERBS:
        try:
            mod = importlib.import_module(f"aiprof.cli.{verb}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("aiprof.cli."):
                continue  # verb not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `aiprof` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if hasattr(args, "max_trace_gb"):  # verbs that read traces: their bounds (aiprof.trace.limits)
            from aiprof.trace.limits import apply_limit_options

            apply_limit_options(args)
        return int(args.func(args) or 0)
    except AiprofError as exc:
        print(f"aiprof: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("aiprof: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
