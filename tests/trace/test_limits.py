"""Bounded analysis (issue 31, item 4): a trace past the limits on inflated JSON, on events or on
the gzip ratio is refused with one line that names the limit and how to raise it, exit 2, no
store or report written; a gzip bomb is refused quickly in bounded memory (a real bomb, a real
``aiprof analyze`` process, its own peak RSS)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bomb import write_bomb  # noqa: E402

from aiprof.trace import limits  # noqa: E402
from aiprof.trace.store import store_dir_for  # noqa: E402

DATA = Path(__file__).parent.parent / "data"
# What refusing a bomb may cost: the interpreter and numpy/pyarrow imports (~100 MB) plus the
# JSON inflated before the ratio check fires (GZIP_RATIO_AFTER_BYTES) and its columns. Without
# the bounds, this bomb drove `aiprof analyze` past 2.5 GB.
BOMB_RSS_BOUND = 512 << 20
RUN_TIMEOUT_S = 300  # generous: the two shared CPUs of CI; the refusal itself takes seconds


# Runs `aiprof analyze` from a small interpreter and prints the peak RSS of that child alone. A
# child forked straight from pytest inherits pytest's resident pages until it execs, and Linux
# keeps that high-water mark in the child's ru_maxrss: late in a full suite, pytest's ~1 GB
# showed up as the analysis's peak. The wrapper's children start from a ~10 MB image instead.
_PEAK_RSS_WRAPPER = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)
"""


def _analyze(*args: str, env: dict | None = None) -> tuple[int, str, int, float]:
    """Run ``aiprof analyze``; its exit code, stderr, peak RSS (bytes) and wall time."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _PEAK_RSS_WRAPPER, sys.executable, "-m", "aiprof", "analyze", *args],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr
    maxrss_kb, rc = (int(x) for x in p.stdout.split())
    return rc, p.stderr, maxrss_kb * 1024, time.monotonic() - t0


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_gzip_bomb_refused_quickly_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.json.gz"
    size = write_bomb(bomb, (1 << 30) + (1 << 20))
    assert size > 1 << 30 and bomb.stat().st_size < 8 << 20
    rc, err, rss, wall = _analyze(str(bomb), "--out", str(tmp_path / "out"))
    print(f"bomb {bomb.stat().st_size:,} B gz, {size:,} B JSON: rc {rc}, peak RSS {rss / 2**20:.0f} MiB, {wall:.1f} s")
    line = _one_line(err)
    assert rc == 2 and "gzip inflates" in line and limits.ENV_MAX_GZIP_RATIO in line, line
    assert rss < BOMB_RSS_BOUND, f"peak RSS {rss / 2**20:.0f} MiB"
    assert not (tmp_path / "out").exists() and not os.path.exists(store_dir_for(str(bomb)))


def test_inflated_bytes_bound(tmp_path):
    """A file under the ratio bound but over --max-trace-gb: stopped at the limit, not at the end."""
    bomb = tmp_path / "big.json.gz"
    write_bomb(bomb, 256 << 20)
    rc, err, rss, _ = _analyze(str(bomb), "--max-trace-gb", "0.0625", env={limits.ENV_MAX_GZIP_RATIO: "2000"})
    line = _one_line(err)
    assert rc == 2 and "decompresses to more than 0.0625 GiB" in line and "--max-trace-gb" in line, line
    assert not os.path.exists(store_dir_for(str(bomb)))
    # the same bound from the environment
    rc, err, _, _ = _analyze(str(bomb), env={limits.ENV_MAX_GZIP_RATIO: "2000", limits.ENV_MAX_TRACE_GB: "0.0625"})
    assert rc == 2 and "0.0625 GiB" in _one_line(err)


def test_plain_json_over_the_bound_refused_before_reading(tmp_path):
    src = tmp_path / "t.json"
    src.write_bytes(b'{"traceEvents": [' + b",".join([b'{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, '
                                                       b'"tid": 1, "ts": 1, "dur": 1}'] * 20_000) + b"]}")
    rc, err, _, _ = _analyze(str(src), "--max-trace-gb", "0.0001")
    line = _one_line(err)
    assert rc == 2 and "is more than 0.0001 GiB of JSON" in line, line


def test_events_bound(tmp_path):
    trace = tmp_path / "t.json.gz"
    trace.write_bytes((DATA / "ddp4_slow2_rank0.json.gz").read_bytes())
    rc, err, _, _ = _analyze(str(trace), "--max-events", "1000", "--out", str(tmp_path / "out"))
    line = _one_line(err)
    assert rc == 2 and "more than 1,000 events" in line and "--max-events" in line, line
    assert not (tmp_path / "out").exists() and not os.path.exists(store_dir_for(str(trace)))
    rc, _, _, _ = _analyze(str(trace), "--max-events", "10000000", "--out", str(tmp_path / "out"))
    assert rc in (0, 1) and (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize("env,opt", [({limits.ENV_MAX_EVENTS: "lots"}, ()), ({}, ("--max-trace-gb", "-1"))])
def test_bad_bound_is_one_line(tmp_path, env, opt):
    rc, err, _, _ = _analyze(str(DATA / "ddp4_slow2_rank0.json.gz"), *opt, env=env)
    assert rc == 2 and ("not a number" in _one_line(err) or "must be > 0" in _one_line(err))
