"""Trace text made safe for a terminal. Kernel, op, frame and file names come from the trace, so
anyone whose code ends up in one chooses them: written raw, an escape sequence in a name
(``\\x1b]0;…\\x07`` sets the window title, ``\\x1b]8;;URL`` makes a link, CSI moves the cursor or
rewrites lines) acts on the reader's terminal, even through a pipe into ``less -R`` or ``cat``.
Every such character is shown as its escape (``\\x1b``) instead: the name stays readable and
distinct, and nothing in it is interpreted. Rich markup is the other half: the renderers print
with ``markup=False`` (names are never parsed as ``[style]``) or pass names through ``escape``.
"""
from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls (ESC, BEL, CR, BS, newline and tab too: a name never holds a line break, and
# one would let a name fake report lines), DEL, and the Unicode direction overrides and isolates
# that reorder what is shown (the "Trojan source" characters)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _esc(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def visible(s: str) -> str:
    """``s`` with every control or direction character replaced by its escape (``\\x1b``)."""
    return _UNSAFE.sub(_esc, s)


def visible_lines(text: str) -> str:
    """``text`` with ``visible`` applied to each of its lines (its own line breaks kept)."""
    return "\n".join(visible(line) for line in text.split("\n"))


def safe(obj: Any) -> Any:
    """A copy of a report (dicts, lists, strings, numbers) with ``visible`` applied to every string,
    keys included: the text renderers apply it once on entry so no field can be missed."""
    if isinstance(obj, str):
        return visible(obj)
    if isinstance(obj, dict):
        return {safe(k) if isinstance(k, str) else k: safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [safe(v) for v in obj]
    return obj


def markup_safe(s: str) -> str:
    """``s`` for a rich string that is parsed as markup (progress columns): controls shown as
    escapes, ``[`` escaped so no part of ``s`` is read as a style or a link."""
    from rich.markup import escape

    return escape(visible(s))
