"""Communication, memory (trace and snapshot) and FLOPs analyses."""
from __future__ import annotations

import gzip
import os
import pickle

import pytest

from aiprof.analysis.comm import comm_analysis
from aiprof.analysis.flops import estimate_flops, flops_analysis, peak_tflops
from aiprof.analysis.memory import load_snapshot, memory_from_snapshot, memory_from_trace
from aiprof.analysis.steps import find_steps
from aiprof.errors import AiprofError
from aiprof.trace.store import open_capture


def test_ddp_collectives(ddp):
    r0, r1 = (comm_analysis(ddp.rank(r)) for r in (0, 1))
    assert set(r0.by_type) == {"AllReduce"}
    g = r0.groups
    assert sum(x.calls for x in g) == 52 and all(x.pg == "0" and x.group_size == 2 for x in g)
    for x in g:  # 2 ranks: AllReduce bus bandwidth factor 2(n-1)/n = 1
        assert x.busbw_gbps == pytest.approx(x.algbw_gbps)
        assert x.bytes_per_call > 0
    # rank 0 waits for the straggler inside all-reduce: far more comm time and more of it exposed
    assert r0.by_type["AllReduce"]["total_us"] > 3 * r1.by_type["AllReduce"]["total_us"]
    assert r0.exposed_us > 3 * r1.exposed_us
    assert r0.link in ("NVLink", "intra-node (NVLink or PCIe)")


def test_no_comm_on_single_gpu(gpt2):
    c = comm_analysis(gpt2)
    assert c.groups == [] and c.by_type == {} and c.total_us == 0.0 and c.link == "unknown"


def test_memory_from_trace(gpt2):
    m = memory_from_trace(gpt2)
    mem = gpt2.memory
    cuda = mem["device_type"] == 1
    assert m.peak_allocated_bytes == int(mem["total_allocated"][cuda].max())
    assert m.peak_reserved_bytes == int(mem["total_reserved"][cuda].max())
    # allocations are credited to real ops, never to the aten::empty* helpers
    assert m.top_allocators and not any(a["where"].startswith("aten::empty") for a in m.top_allocators)
    assert sum(a["bytes"] for a in m.top_allocators) <= int(mem["bytes"][cuda & (mem["bytes"] > 0)].sum())


def test_memory_snapshot_agrees_with_trace(gpt2, memsnap):
    s = memory_from_snapshot(load_snapshot(str(memsnap)))
    t = memory_from_trace(gpt2)
    assert s.source == "snapshot"
    assert s.peak_allocated_bytes == pytest.approx(t.peak_allocated_bytes, rel=0.01)
    assert s.peak_reserved_bytes == t.peak_reserved_bytes
    assert any("train_step" in a["where"] for a in s.top_allocators)


def test_snapshot_loader_runs_no_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    p = tmp_path / "evil.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps({"segments": [Evil()]})))
    with pytest.raises(AiprofError):
        load_snapshot(str(p))
    assert not (tmp_path / "pwned").exists()


def test_snapshot_bomb_is_refused_at_the_trace_limit(tmp_path, monkeypatch):
    """A gzipped snapshot inflates a bounded chunk at a time: 64 MiB of zeros (64 KiB of gzip)
    past a 0.01 GiB limit is one error, not 64 MiB in memory."""
    monkeypatch.setenv("AIPROF_MAX_TRACE_GB", "0.01")
    p = tmp_path / "bomb.pickle.gz"
    with gzip.open(p, "wb") as f:
        for _ in range(64):
            f.write(bytes(1 << 20))
    with pytest.raises(AiprofError, match="more than 0.01 GiB"):
        load_snapshot(str(p))


def test_flops_from_shapes(gpt2):
    st = find_steps(gpt2)
    f = flops_analysis(gpt2, st, "bf16")
    assert f.source == "shapes" and f.peak_tflops == pytest.approx(989.4)
    per = {s["step"]: s["flops"] for s in f.per_step}
    assert len(set(per.values())) == 1  # same model, same shapes every step
    by = {o["op"]: o for o in f.by_op}
    assert by["aten::addmm"]["calls"] == 240  # autocast fp32 wrappers are not counted twice
    # GPT-2 small, 8x1024 tokens: 6*N*T matmul FLOPs (N~124M incl. the tied 50257x768 head) + attention
    tokens = 8 * 1024
    assert 6 * 124e6 * tokens < per[2] < 6 * 124e6 * tokens + 4 * 12 * 8 * 12 * 1024 * 1024 * 64 * 1.01 * 3
    s2 = next(s for s in f.per_step if s["step"] == 2)
    assert s2["mfu_pct"] == pytest.approx(100 * s2["tflops_per_s"] / 989.4)


def test_estimate_flops_and_peaks():
    assert estimate_flops("aten::mm", "[[8192, 768], [768, 3072]]") == 2 * 8192 * 768 * 3072
    assert estimate_flops("aten::addmm", "[[3072], [8192, 768], [768, 3072], [], []]") == 2 * 8192 * 768 * 3072
    assert estimate_flops("aten::bmm", "[[4, 2, 3], [4, 3, 5]]") == 2 * 4 * 2 * 3 * 5
    assert estimate_flops("aten::mm", "garbage") == 0.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert peak_tflops("Some Future GPU", "bf16") is None


def test_cpu_trace_memory_and_flops(tmp_path):
    from _diag import tiny_trace

    rt = open_capture(str(tiny_trace(tmp_path))).ranks[0]
    assert memory_from_trace(rt).source == "none"  # CPU allocations only
    f = flops_analysis(rt, find_steps(rt))
    assert f.total_flops > 0 and f.peak_tflops is None  # with_flops on CPU: counted, no GPU peak
