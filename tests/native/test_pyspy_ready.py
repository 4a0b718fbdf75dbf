"""The sidecar waits for py-spy's first native sample, not for its "Sampling process" line: with
--native that sample loads every library's unwind tables first and came 1-8 s after the line on
a loaded host, so a capture started at the line had no stacks (a CI failure)."""
from __future__ import annotations

import subprocess
import sys
import time

from aiprof.native.sidecar import first_sample_taken

# the job says when its interpreter runs its loop: py-spy attached earlier retries its set-up
JOB = "print('looping', flush=True)\nwhile True:\n    sum(range(1000))\n"


def test_first_sample_taken_waits_for_a_sample_py_spy_took(tmp_path):
    from aiprof.tools import find_py_spy

    exe = find_py_spy()  # the lock installs py-spy: missing is a broken set-up, not a skip
    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True)
    out = tmp_path / "s.raw"
    spy = None
    try:
        assert job.stdout.readline().strip() == "looping"
        # before any sampler runs: no stop to see, the wait ends at its deadline
        assert first_sample_taken(job.pid, job.pid + 10**6, time.monotonic() + 0.3) is None
        # --idle: a sample counts whatever the job's thread was doing when py-spy stopped it
        spy = subprocess.Popen([exe, "record", "--native", "--idle", "--format", "raw", "--rate", "100", "--pid", str(job.pid),
                                "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        took = first_sample_taken(job.pid, spy.pid, time.monotonic() + 60)
        assert took is not None, "py-spy stopped the job for no sample within 60 s"
        # the job ends right after that first sample: py-spy, seeing it gone, writes every sample it
        # took (a SIGINT would drop those its sampling thread has not yet handed over)
        job.kill()
        job.wait()
        spy.wait(timeout=30)
        samples = sum(int(ln.rsplit(" ", 1)[1]) for ln in out.read_text().splitlines() if ln.strip())
        assert samples >= 1, spy.stderr.read() if spy.stderr else ""
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        job.kill()
        job.wait()
    # the job gone: no wait
    assert first_sample_taken(job.pid, 1, time.monotonic() + 5) is None
