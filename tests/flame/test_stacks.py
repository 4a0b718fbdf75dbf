"""AI flame-graph stacks on the real GPT-2 stall and DDP traces (ground truth in tests/data/README.md)."""
from __future__ import annotations

import numpy as np

from aiprof.analysis.intervals import union
from aiprof.analysis.launch import launch_rows
from aiprof.flame import stacks
from aiprof.flame.profile import GPU_PREFIX, diff


def _gpu_ns(rt) -> int:
    return int(rt.kernels["dur"].sum()) + int(rt.memops["dur"].sum())


def test_gpu_weights_sum_to_all_kernel_and_memop_time(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    p = stacks.gpu_profile(rt, forest=gpt2_forest)
    assert p.total == _gpu_ns(rt)  # exact, in ns
    assert all(s[-1].startswith(GPU_PREFIX) for s in p.stacks)
    # every GPU row found its launch: no stack falls back to the "not in trace" root
    assert not any(s[0] == stacks.NO_LAUNCH for s in p.stacks)


def test_widest_gpu_towers_are_gemms_under_forward_and_backward(gpt2_cap, gpt2_forest):
    p = stacks.gpu_profile(gpt2_cap.ranks[0], forest=gpt2_forest)
    top = sorted(p.leaf_totals().items(), key=lambda kv: -kv[1])[:3]
    assert all("gemm" in k for k, _ in top), top
    gemm = [(s, w) for s, w in zip(p.stacks, p.weights.tolist()) if "gemm" in s[-1]]
    fwd = sum(w for s, w in gemm if any(f.endswith(": forward") and ".py(" in f for f in s)
              and not any("backward" in f for f in s))
    bwd = sum(w for s, w in gemm if any(f.startswith("torch/_tensor.py(") and f.endswith(": backward") for f in s))
    total = sum(w for _, w in gemm)
    # GEMM time splits between the model's forward frames and the loss.backward() frames
    assert fwd > 0.25 * total and bwd > 0.4 * total and fwd + bwd > 0.95 * total
    # stack order: Python frames, then torch ops, then the CUDA call, then the kernel
    s = max(gemm, key=lambda sw: sw[1])[0]
    assert s[0].startswith("gpt_train.py(") and s[-2] in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx")
    assert "aten::mm" in s and s.index("aten::mm") > max(i for i, f in enumerate(s) if ".py(" in f)


def test_launch_frame_is_the_correlated_runtime_call(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    k = rt.memops  # memcpy/memset: launched by cudaMemcpyAsync / cudaMemsetAsync, never a kernel launch
    p = stacks.gpu_profile(rt, forest=gpt2_forest)
    rows = launch_rows(rt.runtime, k)
    want = {(rt.runtime["name"][r], n) for r, n in zip(rows, k["name"])}
    got = {(s[-2], s[-1][len(GPU_PREFIX):]) for s in p.stacks if s[-1][len(GPU_PREFIX):].startswith(("Memcpy", "Memset"))}
    assert got == want
    assert {c for c, _ in got} <= {"cudaMemcpyAsync", "cudaMemsetAsync"}


def test_cpu_graph_has_get_batch_with_the_80ms_sleep_in_step_3(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    s3 = stacks.cpu_profile(rt, step=3, forest=gpt2_forest).frame_totals()
    s2 = stacks.cpu_profile(rt, step=2, forest=gpt2_forest).frame_totals()
    gb = "gpt_train.py(22): get_batch"
    # time.sleep is a C call: the Python tracer records it as "<built-in function sleep>"
    assert s3["<built-in function sleep>"] >= 80_000_000
    assert s3[gb] >= s3["<built-in function sleep>"]
    assert s2[gb] < 5_000_000 and "<built-in function sleep>" not in s2
    # the sleep frame sits under get_batch
    cpu = stacks.cpu_profile(rt, step=3, forest=gpt2_forest)
    sleeps = [s for s in cpu.stacks if s[-1] == "<built-in function sleep>"]
    assert sleeps and all(s[-2] == gb for s in sleeps)


def test_cpu_weights_are_exclusive_host_time(gpt2_cap, gpt2_forest):
    """Exclusive times add up to each thread's busy time (union of its host intervals)."""
    rt = gpt2_cap.ranks[0]
    p = stacks.cpu_profile(rt, forest=gpt2_forest)
    expect = 0
    fo = gpt2_forest
    for t in np.unique(fo.tid):
        m = fo.tid == t
        expect += union(fo.start[m], fo.end[m]).total
    assert p.total == expect


def test_forest_agrees_with_python_parent_ids(gpt2_cap, gpt2_forest):
    """Nesting by timestamps reproduces the python_function parent links (ids from the trace)."""
    py = gpt2_cap.ranks[0].python
    fo = gpt2_forest
    off, n = fo.offset["python"], len(py)
    cur = fo.parent[off:off + n].copy()
    found = np.full(n, -2)
    for _ in range(256):  # climb to the nearest Python ancestor
        isp = (cur >= off) & (cur < off + n)
        found = np.where((found == -2) & isp, cur - off, found)
        found = np.where((found == -2) & (cur < 0), -1, found)
        cur = np.where(found == -2, fo.parent[np.maximum(cur, 0)], -1)
        if (found != -2).all():
            break
    index = {p: i for i, p in enumerate(py["py_id"].tolist())}
    want = np.array([index.get(p, -1) for p in py["parent_id"].tolist()])
    agree = float((found == want).mean())
    assert agree > 0.995, agree


def test_steps_partition_the_launched_gpu_time(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    per_step = [stacks.gpu_profile(rt, step=s, forest=gpt2_forest).total for s in (1, 2, 3, 4, 5)]
    assert all(w > 0 for w in per_step)
    assert sum(per_step) <= _gpu_ns(rt)
    # the stall step launches the same work as its neighbours (the GPU idles, it does not do more)
    assert abs(per_step[2] - per_step[1]) < 0.1 * per_step[1]


def test_ranks_merge_and_communication_kernels(ddp2_cap):
    merged = stacks.build(ddp2_cap, "gpu")
    per = [stacks.build(ddp2_cap, "gpu", rank=r.rank) for r in ddp2_cap.ranks]
    assert merged.total == sum(p.total for p in per) == sum(_gpu_ns(r) for r in ddp2_cap.ranks)
    split = stacks.build(ddp2_cap, "gpu", split_ranks=True)
    assert {s[0] for s in split.stacks} == {"rank 0", "rank 1"}
    nccl = {k: w for k, w in per[0].leaf_totals().items() if "nccl" in k.lower()}
    assert nccl and all(k.startswith(GPU_PREFIX + "ncclDevKernel_") for k in nccl)
    # rank 1 does extra matmuls: its GPU graph is wider than rank 0's outside NCCL
    busy = [p.total - sum(w for k, w in p.leaf_totals().items() if "nccl" in k.lower()) for p in per]
    assert busy[1] > busy[0]


def test_differential_between_steps(gpt2_cap, gpt2_forest):
    rt = gpt2_cap.ranks[0]
    d = diff(stacks.cpu_profile(rt, step=2, forest=gpt2_forest), stacks.cpu_profile(rt, step=3, forest=gpt2_forest))
    grew = {s: int(w - b) for s, w, b in zip(d.stacks, d.weights, d.base)}
    top = max(grew, key=grew.get)
    assert top[-1] == "<built-in function sleep>" and grew[top] >= 80_000_000
