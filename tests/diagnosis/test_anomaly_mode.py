"""ANOMALY_MODE on its real pair: a CPU MLP with torch.autograd.set_detect_anomaly(True) and the same
job without it, captured with `aiprof run --skip 20 --iterations 3 --what python` on this 2-core
machine by bench/diagnosis/cpu_anomaly.sh (tests/data/README.md has the unprofiled timings). The
fault's first cause is ANOMALY_MODE with the remedy that turns it off, priced within 1.5x of the
measured saving; the fix has no ANOMALY_MODE (a negative control), and neither do jobs without
anomaly mode."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aiprof.pipeline import build_report
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data"
# (fault - fix) / fault, unprofiled medians of 3 alternating rounds: 6.263 vs 3.546 ms
MEASURED = 0.434


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            d = tmp_path_factory.mktemp(name.replace("/", "_")) / "cap"
            shutil.copytree(DATA / name, d)  # the analysis caches next to the trace: not in the repo
            cache[name] = build_report(open_capture(str(d)))
        return cache[name]
    return get


def test_anomaly_mode_is_the_first_cause_with_its_remedy_and_price(reports):
    rep = reports("anomaly_cpu/fault")
    c = rep["causes"][0]
    assert c["code"] == "ANOMALY_MODE"
    ev = c["evidence"]
    # 6 Linear + 6 GELU + the loss: one NaN check per backward output, every step
    assert ev["nan_checks_per_step"] >= 12 and ev["stack_captures_per_step"] >= 12
    assert len(ev["steps_with_checks"]) == 3
    assert "set_detect_anomaly(True)" in c["remedy"] and "disable debugging APIs" in c["remedy"]
    assert c["place"]["site"].startswith("cpu_anomaly.py(")
    assert MEASURED / 1.5 <= c["saving"]["share"] <= MEASURED * 1.5
    # the checks' ops and the stack captures on the critical path are claimed by it, not left over
    assert not any(x["code"] == "UNEXPLAINED" and "aten::isnan" in x["title"] for x in rep["causes"])


def test_the_fixed_job_has_no_anomaly_cause(reports):
    rep = reports("anomaly_cpu/fix")
    assert not any(x["code"] == "ANOMALY_MODE" for x in rep["causes"] + rep["minor"])


@pytest.mark.parametrize("name", ["v3/healthy_fault", "v3/gc_fault", "cpu_uneven/uneven"])
def test_jobs_without_anomaly_mode_get_no_anomaly_cause(reports, name):
    rep = reports(name)
    assert not any(x["code"] == "ANOMALY_MODE" for x in rep["causes"] + rep["minor"])
