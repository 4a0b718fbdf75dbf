"""Issue 28's 4-rank pairs (tests/data/v3/README.txt): GPU-bound DDP on 4 H100s where rank 0's
sequences are twice as long, the same job with equal lengths (healthy DDP), and the model under
FSDP2 at 192 sequences per rank (GPU-bound: healthy FSDP). The straggler is named with the input
that differs and a remedy about lengths, priced within 1.5x of the measured saving by the joint
replay; the healthy jobs are one line (no orphan waits that only the profiler made)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aiprof.pipeline import build_report
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data" / "v3"
MEASURED = 1 - 25.0 / 47.0  # medians of 3 alternating rounds, fix over fault


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = {}
    for name in ("ddp_uneven_fault", "ddp_uneven_fix", "fsdp_healthy"):
        d = tmp_path_factory.mktemp(name) / name
        shutil.copytree(DATA / name, d)
        out[name] = build_report(open_capture(str(d)))
    return out


def test_the_straggler_is_named_by_its_longer_sequences(reports):
    rep = reports["ddp_uneven_fault"]
    c = rep["causes"][0]
    assert c["code"] == "STRAGGLER" and c["rank"] == 0 and c["saving"]["method"] == "joint replay"
    assert "inputs are larger" in c["title"] and "[48, 1024]" in c["title"] and "[48, 512]" in c["title"]
    assert "same sequence lengths" in c["remedy"]
    assert MEASURED / 1.5 <= c["saving"]["share"] <= MEASURED * 1.5
    assert sorted(c["evidence"]["straggler"]["waiting_ranks"]) == [1, 2, 3]


def _worth_a_line(rep: dict) -> list[tuple]:
    return [(c["code"], c["rank"]) for c in rep["causes"] if c["severity"] in ("high", "medium")]


def test_healthy_ddp_names_only_its_eager_kernels(reports):
    """Equal ranks: no straggler. What is left is the eager model, compiled on every rank at once
    (a job cause): 16.2 % priced, 27.8 % measured (validate_v3.py's failing row: under-priced)."""
    rep = reports["ddp_uneven_fix"]
    assert _worth_a_line(rep) == [("UNCOMPILED_KERNEL_RUNS", None)]
    assert not [s for s in rep["symptoms"] if s["orphan"]]
    assert not [c for c in rep["causes"] if c["code"] == "STRAGGLER"]


def test_healthy_fsdp_names_only_its_eager_kernels(reports):
    # FSDP2's all-gathers and reduce-scatters overlap the compute here; under the profiler rank 1's
    # host ran late (recorded 125 ms steps; unprofiled, rank 0 measured 83 ms): priced at the unprofiled
    # step, neither that nor the exposed collectives is a cause. The eager blocks are (18.0 % priced,
    # 17.3 % measured with each block's forward compiled)
    rep = reports["fsdp_healthy"]
    assert _worth_a_line(rep) == [("UNCOMPILED_KERNEL_RUNS", None)], \
        [(c["code"], c["rank"], c["saving"]["share"]) for c in rep["causes"]]
    assert not [s for s in rep["symptoms"] if s["orphan"]]
