"""Names from a trace are text in every output outside the browser (issue 31, item 2): the text
report (rich) neither parses them as markup nor passes their control characters to the terminal,
and the HTML report and flame graphs hold them escaped. On a real trace whose names are hostile
(tests/hostile_trace.py), through the CLI as a user (or the service's analysis) runs it."""
from __future__ import annotations

import html
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests import hostile_trace as H

# what the report shows for each name it lists: markup as typed, control characters as escapes
SHOWN = {
    "kernel_gemm": "gemm[/bold]",
    "kernel_mul": "[red]x",
    "op_mm": r"a\x1b]0;pwned\x07b",
    "module": "nn.Module: [link=http://x]y[/link]_0",
    "frame": r"evil.py(155): f\x1b[2J\x1b[Hcleared",
    "device": "dev[/bold]",
}


def _aiprof(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def term_trace(tmp_path_factory):
    return H.write(tmp_path_factory.mktemp("term") / "term.json.gz", H.TERM)


@pytest.fixture(scope="module")
def xss_trace(tmp_path_factory):
    return H.write(tmp_path_factory.mktemp("xss") / "xss.json.gz", H.XSS)


def test_text_report_shows_markup_and_control_characters_as_text(term_trace, tmp_path):
    # piped, and --out's report.txt (what the service's analysis writes): a MarkupError here
    # used to fail the capture
    res = _aiprof("analyze", str(term_trace), "--out", str(tmp_path / "out"), AIPROF_PROGRESS="never")
    assert res.returncode == 0, res.stderr
    saved = (tmp_path / "out" / "report.txt").read_text()
    for out in (res.stdout, saved):
        for k, shown in SHOWN.items():
            assert shown in out, k
        assert "\x1b" not in out and "\x07" not in out


def test_text_report_in_colour_holds_no_escape_sequence_from_a_name(term_trace):
    # FORCE_COLOR: rich writes its styles as on a terminal; the names' OSC/CSI sequences stay out
    res = _aiprof("analyze", str(term_trace), FORCE_COLOR="1", AIPROF_PROGRESS="never")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "\x1b[1m" in out  # rich's own bold: colour output is on
    assert "\x1b]" not in out and "\x07" not in out and "\x1b[2J" not in out and "\x1b[H" not in out
    for k in ("kernel_gemm", "kernel_mul", "op_mm", "frame"):
        assert SHOWN[k] in out, k


def test_step_diff_text_shows_names_as_text(term_trace):
    res = _aiprof("diff", str(term_trace), "--base", "2", "--compare", "3", AIPROF_PROGRESS="never")
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert any(SHOWN[k] in res.stdout for k in ("kernel_gemm", "kernel_mul", "op_mm", "frame")), res.stdout


def test_html_report_inlines_names_as_json_escapes(xss_trace, tmp_path):
    out = tmp_path / "report.html"
    res = _aiprof("analyze", str(xss_trace), "--html", str(out), AIPROF_PROGRESS="never")
    assert res.returncode == 0, res.stderr
    page = out.read_text()
    for k, name in H.XSS.items():
        assert name not in page, k
    for k in ("kernel_gemm", "kernel_mul", "frame", "module", "annotation", "device"):  # those the overview holds
        assert H.XSS[k].replace("<", "\\u003c").replace(">", "\\u003e").replace('"', '\\"') in page, k
    assert page.count("</script>") == 2  # the data's and the app's; none from a name


def test_flame_graphs_hold_names_escaped(xss_trace, term_trace, tmp_path):
    assert _aiprof("flame", str(xss_trace), "--what", "both", "-o", str(tmp_path / "f.html")).returncode == 0
    page = (tmp_path / "f.html").read_text()
    for k in ("kernel_gemm", "kernel_mul", "op_mm", "op_mul", "frame", "module"):
        assert H.XSS[k] not in page, k
        assert html.escape(H.XSS[k]) in page, k
    # a standalone SVG is XML, which forbids control characters: shown as escapes, it still parses
    svg = tmp_path / "t.svg"
    assert _aiprof("flame", str(term_trace), "--what", "cpu", "-o", str(svg)).returncode == 0
    labels = [t.text for t in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert SHOWN["op_mm"] in labels and SHOWN["frame"] in labels and SHOWN["module"] in labels


def test_hang_text_shows_control_characters_in_frames_as_escapes():
    """`aiprof hang`'s text (also what the service sends `aiprof trigger --hang`): frame names come
    from the job's code. The recorded result of a real 4-rank hang, one frame renamed."""
    import json

    from aiprof.analysis.hang import format_text
    from tests.conftest import DATA

    res = json.loads((DATA / "hang_nccl_h200x4.json").read_text())
    res["groups"][0]["stack"][0] = "load\x1b]0;pwned\x07_batch\x1b[2J (hang_job.py:49)"
    out = format_text(res)
    assert r"load\x1b]0;pwned\x07_batch\x1b[2J (hang_job.py:49)" in out
    assert "\x1b" not in out and "\x07" not in out
    assert out.count("\n") == len(format_text(json.loads((DATA / "hang_nccl_h200x4.json").read_text()))
                                  .splitlines())  # its own lines kept
