"""aiprof.open(): the store's tables of every rank as Arrow and pandas, labels not codes, units in
the schema; the derived tables (steps and the HTA-style summaries) read the report's numbers."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

import aiprof
from aiprof.pipeline import build_report
from aiprof.api import PANDAS_MISSING, Frame
from tests.api.conftest import ROOT


def test_kernels_of_every_rank_with_their_labels(ddp2_cap):
    assert ddp2_cap.ranks == [0, 1]
    t = ddp2_cap.kernels.to_arrow()
    assert t.column_names[0] == "rank"
    raw = [r.kernels for r in ddp2_cap.raw.ranks]
    assert t.num_rows == sum(len(k) for k in raw) > 0
    assert pa.types.is_dictionary(t.schema.field("name").type)
    for i, r in enumerate(ddp2_cap.raw.ranks):
        rows = t.filter(pa.compute.equal(t.column("rank"), r.rank))
        assert rows.column("name").to_pylist() == raw[i]["name"].tolist()  # decoded: the labels
        assert np.array_equal(rows.column("ts").to_numpy(), raw[i]["ts"])
    assert set(t.column("cls").to_pylist()) == {"compute", "communication"}


def test_units_are_in_the_schema(ddp2_cap):
    t = ddp2_cap.kernels.to_arrow()
    assert t.schema.field("ts").metadata == {b"unit": b"ns"}
    assert t.schema.field("dur").metadata == {b"unit": b"ns"}
    assert t.schema.field("name").metadata is None
    assert ddp2_cap.kernels.units == {"ts": "ns", "dur": "ns", "smem": "bytes"}
    assert ddp2_cap.steps.units["duration_us"] == "us" and ddp2_cap.steps.units["start_ns"] == "ns"


def test_collectives_ops_runtime(ddp2_cap):
    coll = ddp2_cap.collectives.to_arrow()
    assert coll.num_rows > 0 and set(coll.column("side").to_pylist()) == {"cpu", "gpu"}
    assert set(coll.column("coll").to_pylist()) == {"AllReduce"}  # DDP's gradient all-reduce
    assert ddp2_cap.ops.to_arrow().num_rows == sum(len(r.ops) for r in ddp2_cap.raw.ranks)
    rt = ddp2_cap.runtime.to_arrow()
    assert "cudaLaunchKernel" in set(rt.column("name").to_pylist())


def test_counters_are_the_pm_samples(pm_cap):
    c = pm_cap.counters.to_arrow()
    raw = pm_cap.raw.ranks[0].pm
    assert c.num_rows == len(raw) > 0
    assert c.column("metric").to_pylist() == raw["metric"].tolist()
    assert pm_cap.counters.units == {"t0": "ns", "t1": "ns"}
    assert pm_cap.table("hw").to_arrow().num_rows == len(pm_cap.raw.ranks[0].hw) > 0


def test_unknown_table_names_the_tables(stall_cap):
    with pytest.raises(KeyError, match="kernels"):
        stall_cap.table("kernel")


def test_to_pandas_decodes_strings(ddp2_cap, pd):
    df = ddp2_cap.kernels.to_pandas()
    raw = ddp2_cap.raw.ranks[1].kernels
    assert df[df["rank"] == 1]["name"].tolist() == raw["name"].tolist()
    assert not isinstance(df["name"].dtype, pd.CategoricalDtype)
    assert df["dur"].dtype == np.int64 and df.attrs["units"]["dur"] == "ns"
    cat = ddp2_cap.kernels.to_pandas(categorical=True)
    assert isinstance(cat["name"].dtype, pd.CategoricalDtype)
    assert cat["name"].astype(str).tolist() == df["name"].tolist()


def test_empty_table_converts(stall_cap, pd):
    assert len(stall_cap.collectives) == 0  # one rank, no collectives
    df = stall_cap.collectives.to_pandas()
    assert len(df) == 0 and list(df.columns) == stall_cap.collectives.columns


def test_steps_are_the_reports(ddp2_cap, pd):
    rep = ddp2_cap.report()
    df = ddp2_cap.steps.to_pandas()
    assert len(df) == sum(len(r.steps) for r in rep.ranks) == 8
    for r in rep.ranks:
        mine = df[df["rank"] == r.rank]
        assert mine["step"].tolist() == [s.step for s in r.steps]
        assert mine["idle_us"].sum() == pytest.approx(r.summary["idle_us"])
        parts = mine[["compute_us", "communication_us", "memory_us", "idle_us"]].sum(axis=1)
        assert np.allclose(parts, mine["duration_us"])


def test_temporal_breakdown(ddp2_cap, pd):
    df = ddp2_cap.get_temporal_breakdown()
    assert df["rank"].tolist() == [0, 1]
    for r, row in zip(ddp2_cap.report().ranks, df.itertuples()):
        assert row.duration_us == pytest.approx(r.summary["duration_us"])
        assert row.compute_us == pytest.approx(r.summary["compute_us"])
        assert row.idle_us + row.compute_us + row.non_compute_us == pytest.approx(row.duration_us)
        assert row.idle_pctg + row.compute_pctg + row.non_compute_pctg == pytest.approx(100.0)
    assert df.attrs["units"]["idle_us"] == "us" and df.attrs["units"]["idle_pctg"] == "%"


def test_idle_time_breakdown_splits_the_idle_time(stall_cap, pd):
    df = stall_cap.get_idle_time_breakdown()
    summary = stall_cap.report().ranks[0].summary
    assert df["idle_us"].sum() == pytest.approx(summary["idle_us"])
    assert df["idle_ratio"].sum() == pytest.approx(1.0)
    # ground truth (tests/data/README.md): get_batch slept 80 ms with the GPU idle
    top = df.sort_values("idle_us").iloc[-1]
    assert top["idle_category"] == "data loading" and top["idle_us"] > 80_000


def test_comm_comp_overlap(ddp2_cap, stall_cap, pd):
    df = ddp2_cap.get_comm_comp_overlap()
    for r, row in zip(ddp2_cap.report().ranks, df.itertuples()):
        total, exposed = r.summary["communication_total_us"], r.summary["communication_us"]
        assert total > 0 and row.comp_comm_overlap_pctg == pytest.approx(100 * (total - exposed) / total)
    # one rank, no communication: the overlap is unknown, not 0 %
    assert math.isnan(stall_cap.get_comm_comp_overlap()["comp_comm_overlap_pctg"].iloc[0])


def test_gpu_kernel_breakdown(ddp2_cap, pd):
    types, kernels = ddp2_cap.get_gpu_kernel_breakdown()
    assert set(types["cls"]) == {"compute", "communication"}
    assert types["percentage"].sum() == pytest.approx(100.0)
    assert types["total_us"].sum() == pytest.approx(sum(r.kernels["dur"].sum() for r in ddp2_cap.raw.ranks) / 1e3)
    for r in ddp2_cap.report().ranks:  # its first rows are the report's top kernels
        mine = kernels[kernels["rank"] == r.rank].head(len(r.top_kernels))
        assert mine["name"].tolist() == [k.name for k in r.top_kernels]
        assert mine["total_us"].tolist() == pytest.approx([k.total_us for k in r.top_kernels])


def test_report_is_the_clis(stall_cap):
    # the same capture through the library's own entry: one source for each number
    assert stall_cap.report().to_dict() == build_report(stall_cap.raw)


def test_cpu_only_capture_has_no_gpu_numbers(tmp_path, pd):
    # a real CPU-only torch.profiler capture: its GPU breakdown is unknown (NaN), not 0
    script = ROOT / "tests" / "trace" / "scripts" / "tb_cycles.py"
    res = subprocess.run([sys.executable, str(script), str(tmp_path), "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    cap = aiprof.open(tmp_path)
    assert len(cap.kernels) == 0 and len(cap.steps) == 2 and cap.table("steps") is cap.steps
    tb = cap.get_temporal_breakdown()
    assert tb["duration_us"].iloc[0] > 0
    assert tb.drop(columns=["rank", "steps", "duration_us"]).isna().all(axis=None)
    assert cap.get_comm_comp_overlap().drop(columns=["rank"]).isna().all(axis=None)
    assert len(cap.get_idle_time_breakdown()) == 0 and len(cap.get_gpu_kernel_breakdown()[1]) == 0
    assert "none found" in cap.report()._repr_html_()


def test_frame_repr_names_units(stall_cap):
    r = repr(stall_cap.kernels)
    assert "kernels" in r and "ts [ns]" in r and str(len(stall_cap.kernels)) in r
    assert isinstance(stall_cap.kernels, Frame)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "AIPROF_PROGRESS": "never"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


# an import finder that refuses pandas: `import pandas` fails as where pandas is not installed
NO_PANDAS = """
import sys
class NoPandas:
    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoPandas())
"""


def test_without_pandas_one_line_names_pip_install(gpt2_stall):
    res = _python(NO_PANDAS + "import aiprof\n"
                  f"cap = aiprof.open({str(gpt2_stall)!r})\n"
                  "print(len(cap.kernels.to_arrow()))\n"  # Arrow needs no pandas
                  "try:\n    cap.kernels.to_pandas()\n"
                  "except ImportError as e:\n    print('ERR', e)\n")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert int(lines[0]) > 0
    assert lines[1] == f"ERR {PANDAS_MISSING}" and "pip install pandas" in PANDAS_MISSING
    assert len(lines) == 2


def test_import_aiprof_stays_light():
    # the agent imports the package inside the user's job: aiprof.open loads the analysis on first use
    res = _python("import sys, aiprof\n"
                  "print(sorted(m for m in ('numpy', 'pyarrow', 'aiprof.api') if m in sys.modules))\n"
                  "print(aiprof.open.__module__)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[]", "aiprof.api.capture"]
