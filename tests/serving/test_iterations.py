"""Iterations found with no step marker (analysis/iterations.py), on real CPU captures of a tiny
transformers model and on the real H100 GPT-2 generate trace."""
from __future__ import annotations

import numpy as np

from aiprof.analysis import iterations
from aiprof.analysis.steps import find_steps
from tests.serving.support import fixture_rank, rank, truth


def test_generate_fixture_gets_per_token_iterations(tmp_path):
    # each ProfilerStep holds a whole generate call: it is split into one iteration per forward
    rt = fixture_rank("scenarios/generate_b1.json.gz", tmp_path)
    st = find_steps(rt)
    assert (st.source, st.within, len(st)) == ("module:GPT2LMHeadModel_0", "ProfilerStep", 24)
    assert np.all(st.end > st.start) and np.all(st.start[1:] >= st.end[:-1])


def test_entry_overrides_the_automatic_rule(tmp_path):
    rt = fixture_rank("scenarios/generate_b1.json.gz", tmp_path)
    st = find_steps(rt, entry="nn.Module: GPT2Model_0")
    assert (st.source, len(st)) == ("entry:nn.Module: GPT2Model_0", 24)
    # and an entry can ask for the markers themselves
    assert find_steps(rt, entry="generation/utils.py(2394): generate").source.startswith("entry:")


def test_generate_module_forwards(captures, tmp_path):
    rt = rank(captures, "generate", tmp_path)
    st = find_steps(rt)
    assert st.source == "module:GPT2LMHeadModel_0" and st.within == ""
    assert len(st) == truth(captures, "generate")["forwards"]


def test_generate_without_stacks_uses_the_op_sequence(captures, tmp_path):
    rt = rank(captures, "generate_nostack", tmp_path)
    assert not len(rt.python)
    st = find_steps(rt)
    assert st.source.startswith("ops:")
    assert len(st) == truth(captures, "generate_nostack")["forwards"]


def test_profiler_steps_holding_generate_calls_are_split(captures, tmp_path):
    rt = rank(captures, "generate_steps", tmp_path)
    t = truth(captures, "generate_steps")
    st = find_steps(rt)
    assert (st.source, st.within, len(st)) == ("module:GPT2LMHeadModel_0", "ProfilerStep", t["forwards"])
    assert st.marker_mean_ns > 0


def test_continuous_batching_engine_steps(captures, tmp_path):
    rt = rank(captures, "cb", tmp_path)
    st = find_steps(rt)
    assert st.source == "engine:continuous_api._generation_loop_body"
    # every engine step is an iteration that runs the model; the loop's other bodies waited
    u = iterations.module_units(rt)
    with_forward = np.unique(st.index_of(u.start))
    assert len(with_forward[with_forward >= 0]) == truth(captures, "cb")["engine_steps"]


def test_training_loop_without_markers(captures, tmp_path):
    rt = rank(captures, "train", tmp_path)
    assert iterations.has_backward(rt)
    st = find_steps(rt)
    assert (st.source, len(st)) == ("module:GPT2LMHeadModel_0", truth(captures, "train")["iterations"])
    # the backward pass and the update are inside the iterations: they run from forward to forward
    o = rt.ops
    bwd = o.strings("name").isin_labels(lambda s: "Backward" in s)
    assert (st.index_of(o["ts"][bwd]) >= 0).all()


def test_iteration_windows_end_runs_at_long_gaps():
    # units every 10 ms, then the loop waits 1 s (no requests), then three more
    start = np.array([0, 10, 20, 30, 1030, 1040, 1050], dtype=np.int64) * 1_000_000
    u = iterations.Units(start, start + 8_000_000, "module:M")
    s, e = iterations.iteration_windows(u, 0, 2_000_000_000)
    assert list(s) == list(start)
    assert e[3] == 30_000_000 + 10_000_000  # its unit plus the usual 2 ms after a unit, not the wait
    assert list(e[:3]) == [10_000_000, 20_000_000, 30_000_000]
    assert e[-1] == 1050_000_000 + 10_000_000
    # a window that ends soon after the last unit (its backward pass, its last sampling) keeps it
    s, e = iterations.iteration_windows(u, 0, 1_065_000_000)
    assert e[-1] == 1_065_000_000


def test_gpu_only_export_uses_the_kernel_sequence(tmp_path):
    # the H200 GPT-2 training trace with its host events removed: the kernels' period is the step
    import gzip
    import json

    from aiprof.trace.store import open_capture
    from tests.serving.support import DATA

    with gzip.open(DATA / "gpt2_train_stall.json.gz") as f:
        doc = json.load(f)
    steps = find_steps(fixture_rank("gpt2_train_stall.json.gz", tmp_path))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    p = tmp_path / "gpu_only.json"
    p.write_text(json.dumps(doc))
    st = find_steps(open_capture(str(p), show_progress=False).ranks[0])
    assert st.source.startswith("kernels:") and len(st) == len(steps) == 5
