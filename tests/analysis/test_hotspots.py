"""Host call trees, GPU-idle attribution, hotspots and bottleneck ratios on the real traces."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.analysis.breakdown import step_breakdown
from aiprof.analysis.hotspots import (PYTHON, _nest, _timeline, gpu_gaps, host_tree, hotspots,
                                      is_data_loading, is_library_frame)
from aiprof.analysis.steps import find_steps
from aiprof.trace.store import open_capture


@pytest.fixture(scope="module")
def gpt2(gpt2_stall):
    return open_capture(str(gpt2_stall)).ranks[0]


def test_nest_clips_improper_overlap():
    # i=[0,10) j=[5,15) overlaps i improperly; k=[12,13) starts after i ended
    start = np.array([0, 5, 12])
    end = np.array([10, 15, 13])
    depth, parent, e = _nest(start, end)
    assert parent.tolist() == [-1, 0, -1]
    assert e.tolist() == [10, 10, 13]
    s, ee, top = _timeline(start, e, depth, parent)
    assert list(zip(s.tolist(), ee.tolist(), top.tolist())) == [(0, 5, 0), (5, 10, 1), (10, 12, -1), (12, 13, 2)]


def test_tree_is_well_formed(gpt2):
    t = host_tree(gpt2)
    assert len(t) > 70_000
    assert (t.end >= t.start).all()
    p = t.parent
    has = p >= 0
    assert (t.start[has] >= t.start[p[has]]).all() and (t.end[has] <= t.end[p[has]]).all()
    assert (t.depth[has] == t.depth[p[has]] + 1).all()
    # the main thread's timeline tiles time without overlap
    assert (t.seg_start[1:] >= t.seg_end[:-1]).all()


def test_sleep_frame_and_get_batch(gpt2):
    t = host_tree(gpt2)
    excl = t.exclusive_ns()
    names = np.array(t.labels, dtype=object)[t.code]
    sleep = np.nonzero(names == "<built-in function sleep>")[0]
    assert len(sleep) == 1
    n = int(sleep[0])
    assert excl[n] == t.end[n] - t.start[n] == 80_190_079  # the injected time.sleep(0.08)
    assert "gpt_train.py(22): get_batch" in t.stack(n)
    assert t.user_site(n) == "gpt_train.py(22): get_batch"


def test_gaps_partition_the_breakdown_idle(gpt2):
    steps = find_steps(gpt2)
    g = gpu_gaps(gpt2, steps)
    per_step = np.bincount(g.step, weights=g.dur, minlength=len(steps)) / 1000.0
    idle = np.array([b.idle_us for b in step_breakdown(gpt2, steps)])
    assert np.allclose(per_step, idle, atol=0.01)
    # step 3 (index 2): ~80 ms of it while get_batch (a data-loading function) runs
    load = np.bincount(g.step[g.loading], weights=g.dur[g.loading], minlength=len(steps)) / 1000.0
    assert 80_190 < load[2] < 82_000
    assert load[[0, 1, 3, 4]].max() < 1_000


def test_hotspots_and_classes(gpt2):
    h = hotspots(gpt2, top=40)
    by = {i.name: i for i in h.items}
    gb = by["gpt_train.py(22): get_batch"]
    assert gb.calls == 5 and gb.kind == "python"
    assert 82_000 < gb.inclusive_us < 82_100 and gb.gpu_us < 100  # launches almost nothing
    assert gb.bottleneck_ratio == pytest.approx(gb.idle_us / h.window_us)
    classes = {c.cls: c for c in h.classes}
    assert classes["host: data loading"].time_us > 80_190
    assert classes["gpu: compute"].time_us == pytest.approx(sum(b.compute_us for b in step_breakdown(gpt2, find_steps(gpt2))), rel=1e-6)
    host = sum(c.time_us for k, c in classes.items() if k.startswith("host:"))
    assert host == pytest.approx(h.gpu_idle_us, rel=1e-6)


def test_name_predicates():
    assert is_data_loading("gpt_train.py(22): get_batch")
    assert is_data_loading("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__")
    assert not is_data_loading("torch/optim/adam.py(214): step")
    assert is_library_frame("torch/nn/modules/module.py(1783): _call_impl")
    assert not is_library_frame("gpt_train.py(29): train_step")


def test_cpu_trace_has_no_gpu_analyses(tmp_path):
    from _diag import tiny_trace

    rt = open_capture(str(tiny_trace(tmp_path))).ranks[0]
    h = hotspots(rt)
    assert not h.has_gpu and h.classes == [] and h.gpu_idle_us == 0.0
    assert any(i.name.endswith("train_step") for i in h.items)
    assert host_tree(rt).kind[host_tree(rt).kind == PYTHON].size > 0
