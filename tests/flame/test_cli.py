"""`aiprof flame` and `aiprof export` end to end: outputs written whole, user errors exit 2."""
from __future__ import annotations

import json
import os

from aiprof.cli.main import main


def test_flame_outputs(gpt2_stall, tmp_path, capsys):
    d = tmp_path
    assert main(["flame", str(gpt2_stall), "-o", str(d / "g.svg")]) == 0
    assert main(["flame", str(gpt2_stall), "--what", "both", "-o", str(d / "b.html")]) == 0
    assert main(["flame", str(gpt2_stall), "--what", "cpu", "--step", "3", "--diff-step", "2", "-o", str(d / "d.folded")]) == 0
    assert main(["flame", str(gpt2_stall), "--what", "both", "-o", str(d / "s.json")]) == 0
    assert (d / "g.svg").read_text().startswith("<svg")
    assert len(json.loads((d / "s.json").read_text())["profiles"]) == 2
    lines = (d / "d.folded").read_text().splitlines()
    assert all(len(l.rsplit(" ", 2)) == 3 for l in lines)
    assert any("get_batch;<built-in function sleep> 0 " in l for l in lines)
    err = capsys.readouterr().err
    assert "GPU rank 0: " in err and "wrote" in err


def test_flame_user_errors_leave_no_file(gpt2_stall, tmp_path, capsys):
    out = tmp_path / "x.svg"
    assert main(["flame", str(gpt2_stall), "--step", "99", "-o", str(out)]) == 2
    assert "no step 99" in capsys.readouterr().err
    assert main(["flame", str(gpt2_stall), "--what", "both", "-o", str(out)]) == 2
    assert main(["flame", str(gpt2_stall), "-o", str(tmp_path / "x.unknown")]) == 2
    assert main(["flame", str(gpt2_stall), "--rank", "3", "-o", str(out)]) == 2
    assert not out.exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".aiprof-")]


def test_export_verbs(gpt2_stall, tmp_path):
    for fmt, name in (("perfetto", "t.pftrace"), ("chrome", "t.json"), ("speedscope", "s.json"), ("folded", "f.txt")):
        assert main(["export", str(gpt2_stall), "--format", fmt, "-o", str(tmp_path / name)]) == 0
        assert (tmp_path / name).stat().st_size > 1000
    assert main(["export", str(gpt2_stall), "-o", str(tmp_path / "no" / "t.pftrace")]) == 2


def test_flame_from_pyspy(tmp_path):
    from pathlib import Path

    raw = Path(__file__).parents[1] / "data" / "pyspy_spin.raw"
    assert main(["flame", "--pyspy", str(raw), "-o", str(tmp_path / "p.svg")]) == 0
    assert "inner (spin.py:4)" in (tmp_path / "p.svg").read_text()
