"""The text report follows the terminal: $COLUMNS, else the terminal's width, else a fixed
width when piped (so saved reports are the same on every machine)."""
from __future__ import annotations

from clisupport import aiprof, aiprof_in_tty

from aiprof.report.text import PIPED_WIDTH


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_columns_sets_the_width(small_trace):
    for cols in (80, 200):
        res = aiprof("analyze", str(small_trace), COLUMNS=str(cols))
        assert res.returncode == 0, res.stderr
        assert _widest(res.stdout) <= cols
        # wider than the piped width: the report used the room $COLUMNS gave it (no line need
        # fill it exactly: tables grow only as wide as their contents)
        assert cols < PIPED_WIDTH or _widest(res.stdout) > PIPED_WIDTH


def test_piped_without_columns_is_fixed(small_trace, tmp_path):
    res = aiprof("analyze", str(small_trace), "--out", str(tmp_path / "rep"))
    assert res.returncode == 0 and _widest(res.stdout) == PIPED_WIDTH
    # report.txt is a file: the fixed width even when $COLUMNS says otherwise
    aiprof("analyze", str(small_trace), "--out", str(tmp_path / "rep2"), COLUMNS="90")
    assert _widest((tmp_path / "rep2" / "report.txt").read_text()) == PIPED_WIDTH


def test_terminal_width_is_followed(small_trace):
    rc, out = aiprof_in_tty("analyze", str(small_trace), cols=100, AIPROF_PROGRESS="never")
    assert rc == 0, out
    body = [line for line in out.splitlines() if "\x1b" not in line]  # styled lines carry escapes
    assert body and _widest("\n".join(body)) == 100
