"""CI gates: ``analyze --fail-on`` and ``diff --fail-if-slower`` (docs/report.md, "Use in CI").

A gate that trips exits GATE_EXIT after every output is written, with one line on stderr
saying why; a usage error stays 2 (argparse, AiprofError) so CI can tell "the job regressed"
from "the check itself is broken".
"""
from __future__ import annotations

from typing import Any

GATE_EXIT = 3
SEVERITIES = ("high", "medium", "low")  # most severe first: --fail-on medium also trips on high


def causes_at_or_above(report: dict[str, Any], level: str) -> list[dict[str, Any]]:
    """The report's causes whose severity is ``level`` or more severe."""
    worst = SEVERITIES[: SEVERITIES.index(level) + 1]
    return [c for c in report.get("causes", []) if c.get("severity") in worst]


def fail_on_message(report: dict[str, Any], level: str) -> str | None:
    """One line naming the causes that trip ``--fail-on level``, or None when none does."""
    hits = causes_at_or_above(report, level)
    if not hits:
        return None
    codes = ", ".join(f"{c['code']} ({c['severity']})" for c in hits)
    return f"--fail-on {level}: {len(hits)} cause(s) at {level} severity or above: {codes}"


def slower_pct(diff: dict[str, Any]) -> float | None:
    """How much slower the compared step is than the base step, in percent (None: no base time)."""
    base, cmp = diff["base"]["duration_us"], diff["compare"]["duration_us"]
    return None if base <= 0 else 100.0 * (cmp - base) / base


def fail_if_slower_message(diff: dict[str, Any], pct: float, which: str) -> str | None:
    """One line when the compared step is more than ``pct`` % slower than the base step, else None.
    ``which`` names the statistic the two steps stand for ("median step")."""
    got = slower_pct(diff)
    if got is None or got <= pct:
        return None
    b, c = diff["base"], diff["compare"]
    return (f"--fail-if-slower {pct:g}: B's {which} {c['duration_us'] / 1000:,.2f} ms vs A's "
            f"{b['duration_us'] / 1000:,.2f} ms: {got:+.1f}% (limit +{pct:g}%)")
