"""The report's causes as an HTML table, for notebooks (``Report._repr_html_``).

A renderer: it formats what aiprof.diagnosis computed and computes nothing. Every string from
the report is escaped (quotes too, for attributes): titles, places and stacks hold names from
the trace, which whoever wrote the trace chose (docs/security.md).
"""
from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiprof.api.report import Cause, Report

_COLUMNS = ("#", "severity", "cause", "rank", "saves ms / step", "of the step", "what", "where", "fix")
_STYLE = {"high": "color:#b00020;font-weight:bold", "medium": "color:#a15c00", "low": "color:#006080"}


def _ms(us: float) -> str:
    return f"{us / 1000.0:,.2f}"


def _where(c: "Cause") -> str:
    p = c.place
    where = p.site or p.name
    if p.steps:
        where += f" (steps {', '.join(map(str, p.steps))})"
    stack = "\n".join(p.stack)  # the call stack shows on hover
    return f'<td title="{escape(stack)}">{escape(where)}</td>' if stack else f"<td>{escape(where)}</td>"


def _row(i: int, c: "Cause") -> str:
    who = "job" if c.rank is None else str(c.rank)
    cells = [
        f"<td>{i}</td>",
        f'<td style="{_STYLE.get(c.severity, "")}">{escape(c.severity)}</td>',
        f"<td><code>{escape(c.code)}</code></td>",
        f"<td>{escape(who)}</td>",
        f'<td style="text-align:right;white-space:nowrap">{_ms(c.saving.per_step_us)}</td>',
        f'<td style="text-align:right;white-space:nowrap">{100 * c.saving.share:.1f}% of {_ms(c.saving.baseline_step_us)} ms</td>',
        f"<td>{escape(c.title)}</td>",
        _where(c),
        f"<td>{escape(c.remedy)}</td>",
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def causes_table(report: "Report") -> str:
    """The causes, ranked by what fixing them saves, as an HTML table (one ``<table>``)."""
    ranks = report.capture.ranks_found
    head = (f"aiprof: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}, {len(report.causes)} "
            f"cause{'s' if len(report.causes) != 1 else ''}, by what fixing them saves (docs/findings.md)")
    if not report.causes:
        return (f'<div class="aiprof-report"><p>{escape(head)}</p>'
                "<p>Causes: none found (no fix would save 1% of a step)</p></div>")
    rows = "".join(_row(i, c) for i, c in enumerate(report.causes, 1))
    th = "".join(f"<th>{escape(h)}</th>" for h in _COLUMNS)
    return (f'<div class="aiprof-report"><table class="aiprof-causes"><caption style="text-align:left">'
            f"{escape(head)}</caption><thead><tr>{th}</tr></thead><tbody>{rows}</tbody></table></div>")
