"""Every verb's help explains every option, once: a help text each, at most one stated default,
and the default stated wherever the option has one."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from aiprof.protocol import NATIVE_LEVELS, WHAT_LEVELS
from aiprof.cli.main import build_parser

_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


def _verbs() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


@pytest.mark.parametrize("verb", sorted(_verbs()))
def test_every_option_has_help_and_one_default(verb):
    p = _verbs()[verb]
    for a in _options(p):
        name = "/".join(a.option_strings) or a.dest
        assert a.help and a.help.strip(), f"aiprof {verb} {name}: no help text"
        text = p._get_formatter()._expand_help(a).replace("'default'", "")  # a value named default
        assert len(_DEFAULT.findall(text)) <= 1, f"aiprof {verb} {name}: several defaults in {text!r}"
        has_default = a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS) and a.nargs != 0
        if has_default:
            assert _DEFAULT.search(text), f"aiprof {verb} {name}: default {a.default!r} not stated in {text!r}"


def test_what_lists_every_level():
    for verb in ("run", "attach", "trigger"):
        what = next(a for a in _options(_verbs()[verb]) if "--what" in a.option_strings)
        for level in WHAT_LEVELS + NATIVE_LEVELS:
            assert level in what.help, f"aiprof {verb} --what: {level} missing"


def test_help_runs_for_every_verb():
    """The real command: `aiprof VERB --help` exits 0 and prints a usage line."""
    for verb in sorted(_verbs()):
        res = subprocess.run([sys.executable, "-m", "aiprof", verb, "--help"], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0 and res.stdout.startswith(f"usage: aiprof {verb}"), (verb, res.stderr)
