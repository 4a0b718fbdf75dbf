"""`aiprof ui` as a user runs it: prints its URL, serves the API, binds 127.0.0.1 by default."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request


def test_aiprof_ui_serves_and_prints_its_url(gpt2_stall):
    p = subprocess.Popen([sys.executable, "-m", "aiprof", "ui", str(gpt2_stall), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line + p.stderr.read()
        meta = json.load(urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/api/meta", timeout=60))
        assert meta["world_size"] == 1 and meta["ranks"][0]["steps"] == [1, 2, 3, 4, 5]
    finally:
        p.terminate()
        p.wait(10)


def test_aiprof_ui_bad_port_is_a_one_line_error(gpt2_stall):
    r = subprocess.run([sys.executable, "-m", "aiprof", "ui", str(gpt2_stall), "--port", "70000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--port" in r.stderr
