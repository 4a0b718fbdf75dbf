"""Progress on stderr, on a terminal only: decided by how much JSON the traces hold (a .gz by its
ISIZE trailer), and drawn for the analysis phase as well as the ingest."""
from __future__ import annotations

import gzip
import os

from clisupport import DATA, aiprof_in_tty

from aiprof.trace.store import PROGRESS_MIN_BYTES, json_bytes


def test_json_bytes_reads_the_gzip_trailer(tmp_path):
    for name in ("gpt2_train_stall.json.gz", "scenarios/fp32_matmul.json.gz"):
        f = DATA / name
        assert json_bytes(str(f)) == len(gzip.decompress(f.read_bytes()))
    plain = tmp_path / "t.json"
    plain.write_bytes(gzip.decompress((DATA / "scenarios" / "fp32_matmul.json.gz").read_bytes()))
    assert json_bytes(str(plain)) == os.path.getsize(plain)


def _padded(tmp_path, pad: int):
    """The small real trace with ``pad`` spaces of JSON whitespace before its last brace: a small
    .gz on disk that holds a lot of JSON (as a 15 MB .gz holds 204 MB)."""
    doc = gzip.decompress((DATA / "scenarios" / "fp32_matmul.json.gz").read_bytes()).rstrip()
    assert doc.endswith(b"}")
    out = tmp_path / "padded.json.gz"
    out.write_bytes(gzip.compress(doc[:-1] + b" " * pad + b"}", compresslevel=6))
    return out


def test_bar_by_json_size_and_for_the_analysis(tmp_path):
    big = _padded(tmp_path, PROGRESS_MIN_BYTES + (1 << 20))
    assert os.path.getsize(big) < PROGRESS_MIN_BYTES < json_bytes(str(big))
    rc, out = aiprof_in_tty("analyze", str(big), cols=120)
    assert rc == 0, out
    assert "ingest" in out and "analyse 1 rank(s)" in out
    small = tmp_path / "small"
    small.mkdir()
    (small / "t.json.gz").write_bytes((DATA / "scenarios" / "fp32_matmul.json.gz").read_bytes())
    rc, out = aiprof_in_tty("analyze", str(small / "t.json.gz"), cols=120)
    assert rc == 0 and "analyse 1 rank(s)" not in out and "ingest" not in out
