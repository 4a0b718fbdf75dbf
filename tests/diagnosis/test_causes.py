"""Every cause detector on the real H100 job that has its fault (tests/data/diagnosis, captured by
bench/diagnosis/gpu_pairs.py), analysed as an aiprof capture with the unprofiled step time the
agent would have recorded; and the healthy jobs stay quiet."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aiprof.pipeline import build_report
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data" / "diagnosis"
PAIRS = json.loads((DATA / "pairs.json").read_text())["pairs"]


def report(tmp_path_factory, name: str) -> dict:
    p = PAIRS[name]
    fault = p["traces"].get("fault") or p["traces"]["job"]
    traces = fault if isinstance(fault, list) else [fault]
    d = tmp_path_factory.mktemp(name)
    for r, t in enumerate(traces):
        rd = d / f"rank{r}"
        rd.mkdir()
        shutil.copy(DATA / t, rd / "trace.json.gz")
        before = p["per_rank_ms"][str(r)]["fault"] if "per_rank_ms" in p else (p.get("fault_ms") or p["step_ms"])
        (rd / "meta.json").write_text(json.dumps({"schema": "aiprof.capture/1", "steps": {"before_median_ms": before}}))
    return build_report(open_capture(str(d)))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = report(tmp_path_factory, name)
        return cache[name]
    return get


def top(rep: dict) -> dict:
    assert rep["causes"], "no cause"
    return rep["causes"][0]


def within(pred: float, meas: float, factor: float = 1.5) -> bool:
    return meas / factor <= pred <= meas * factor


def test_allocator_churn_names_empty_cache(reports):
    c = top(reports("alloc_churn"))
    assert c["code"] == "ALLOCATOR_CHURN" and c["evidence"]["empty_cache"]
    assert "empty_cache()" in c["remedy"] and "gpu_pairs.py" in c["place"]["site"]
    assert within(c["saving"]["share"], PAIRS["alloc_churn"]["measured_share"])


def test_new_shapes_names_cudnn_search_and_the_shapes(reports):
    c = top(reports("new_shapes"))
    assert c["code"] == "NEW_INPUT_SHAPES" and c["evidence"]["kind"] == "cuDNN algorithm search"
    assert c["evidence"]["distinct_shapes"] >= 3 and "pad or bucket" in c["remedy"]
    assert within(c["saving"]["share"], PAIRS["new_shapes"]["measured_share"])


def test_unfused_optimizer_is_fused_not_graphed(reports):
    rep = reports("unfused_optimizer")
    # validate.py's failing row: the model's eager kernels come first (12.2 %), priced over what
    # compiling saved on the same model (compile_gpt2: 13.0 % predicted, 9.0 % measured)
    assert top(rep)["code"] == "UNCOMPILED_KERNEL_RUNS"
    c = next(x for x in rep["causes"] if x["code"] == "UNFUSED_OPTIMIZER")
    assert "fused=True" in c["remedy"]
    assert c["evidence"]["tensors"] == 76  # GPT-2 6x768: 12 tensors a block, 4 more
    assert within(c["saving"]["share"], PAIRS["unfused_optimizer"]["measured_share"])
    # CUDA graphs would also hide the optimizer's launches: the generic cause is priced after it
    lb = [x for x in rep["causes"] if x["code"] == "LAUNCH_BOUND"]
    assert all("UNFUSED_OPTIMIZER" in x["saving"]["marginal_to"] for x in lb)


def test_per_tensor_item_is_one_cause_at_its_line(reports):
    rep = reports("item_per_param")
    c = top(rep)
    assert c["code"] == "HOST_SYNC" and c["evidence"]["pattern"] == "per-tensor"
    # three reads per parameter tensor (norm, largest magnitude, mean) of GPT-2's 76; each read
    # waits twice (its copy and its stream sync): the count is of reads
    assert c["evidence"]["calls_per_step"] == 3 * 76 and "torch.stack" in c["remedy"]
    assert "gpu_pairs.py" in c["place"]["site"]
    # validate.py's failing row: 12.8 % predicted of 20.0 % measured (3 rounds, 32.9-36.3 ms for the fault)
    assert 0.1 < c["saving"]["share"] < PAIRS["item_per_param"]["measured_share"]


def test_the_per_tensor_read_loop_is_not_launch_bound(reports):
    """The loop that computes and reads each statistic between the reads is HOST_SYNC's: no CUDA
    graph can hold it while it synchronizes, so LAUNCH_BOUND's launches are the model's. Its fix
    gains more once the reads stop draining the queue (priced after HOST_SYNC); as the job is it
    saves less than HOST_SYNC, and ranks below it."""
    rep = reports("item_per_param")
    (lb,) = [x for x in rep["causes"] if x["code"] == "LAUNCH_BOUND"]
    stats = {"aten::linalg_vector_norm", "aten::abs", "aten::max", "aten::mean", "aten::item"}
    assert not stats & {o["op"] for o in lb["evidence"]["launching_ops"]}
    assert lb["evidence"]["launches_per_step"] < 600  # 925 with the loop's
    sv = lb["saving"]
    assert "HOST_SYNC" in sv["marginal_to"] and sv["alone_us"] < sv["per_step_us"]
    assert sv["alone_us"] < top(rep)["saving"]["per_step_us"]


def test_host_preprocessing_names_the_tokenizer(reports):
    c = top(reports("host_tokenize"))
    assert c["code"] == "HOST_PREPROCESSING" and "next_ids" in c["evidence"]["function"]
    assert "worker" in c["remedy"]
    assert c["saving"]["share"] > 0.3  # measured 48.6 % (the committed trace is trimmed: bench reports the full one)


def test_launch_bound(reports):
    c = top(reports("launch_bound"))
    assert c["code"] == "LAUNCH_BOUND" and "CUDA graph" in c["remedy"]
    assert within(c["saving"]["share"], PAIRS["launch_bound"]["measured_share"])


def test_fp32_matmul(reports):
    c = top(reports("fp32_matmul"))
    assert c["code"] == "MATMUL_OFF_TENSOR_CORES" and "allow_tf32" in c["remedy"]
    assert within(c["saving"]["share"], PAIRS["fp32_matmul"]["measured_share"])


def test_pageable_copy(reports):
    rep = reports("pageable_copy")
    c = top(rep)
    assert c["code"] == "PAGEABLE_COPY" and "pin_memory" in c["remedy"]
    assert within(c["saving"]["share"], PAIRS["pageable_copy"]["measured_share"])
    assert "HOST_SYNC" not in [x["code"] for x in rep["causes"]]  # the copy's own sync is not a read


def test_dataloader_starved(reports):
    c = top(reports("dataloader_starved"))
    assert c["code"] == "DATALOADER_STARVED" and c["evidence"]["num_workers_zero"]
    assert "num_workers=" in c["remedy"]
    assert within(c["saving"]["share"], PAIRS["dataloader_starved"]["measured_share"])


@pytest.mark.parametrize("name", ["healthy_gpt2", "healthy_compiled"])
def test_healthy_jobs_are_quiet(reports, name):
    """Quiet but for a cause another pair measured on the same job (pairs.json "measured": ATen's
    LayerNorm backward on GPT-2, SM_ARRAY_IDLE, whose remedy saved 6.1 % on v3_job.py's model)."""
    rep = reports(name)
    measured = set(PAIRS[name].get("measured", []))
    assert not [c for c in rep["causes"] if c["severity"] in ("high", "medium") and c["code"] not in measured], \
        [(c["code"], c["severity"], c["saving"]["share"]) for c in rep["causes"]]


def test_straggler_cause_explains_the_waits(reports):
    rep = reports("straggler2")
    c = top(rep)
    assert c["rank"] == 1 and c["code"] == "DATALOADER_STARVED" and c["evidence"]["straggler"]["rank"] == 1
    assert "rank 1 is the straggler" in c["title"] and "get_batch" in c["title"]
    assert c["saving"]["method"] == "joint replay"
    assert within(c["saving"]["share"], PAIRS["straggler2"]["measured_share"])
    waits = [s for s in rep["symptoms"] if s["code"] == "WAITING_RANK"]
    assert [s["rank"] for s in waits] == [0]
    assert waits[0]["explained_by"][0]["cause"] == c["id"]
    # a wait is never longer than the time the rank analysed
    total = sum(s["duration_us"] for s in rep["ranks"][0]["steps"])
    assert 0 < waits[0]["us"] <= total


def test_report_is_json_and_causes_are_ranked(reports):
    rep = reports("alloc_churn")
    assert rep["schema"] == "aiprof.report/2"
    json.dumps(rep)
    s = [c["saving"]["per_step_us"] for c in rep["causes"]]
    assert s == sorted(s, reverse=True)
    for c in rep["causes"]:
        assert set(c) >= {"id", "code", "rank", "title", "mechanism", "remedy", "place", "saving", "severity", "symptoms"}
        assert c["saving"]["fixed_step_us"] <= c["saving"]["baseline_step_us"]
    b = rep["baseline"][0]
    assert b["unprofiled_step_us"] == pytest.approx(PAIRS["alloc_churn"]["fault_ms"] * 1000)
    # the replay was calibrated to the unprofiled step it was given
    assert b["replayed_step_us"] == pytest.approx(b["unprofiled_step_us"], rel=0.02)


def test_grad_accum_allreduce_is_a_job_cause(reports):
    rep = reports("accum2")
    c = top(rep)
    assert c["code"] == "GRAD_ACCUM_ALLREDUCE" and c["rank"] is None and "no_sync()" in c["remedy"]
    ev = c["evidence"]
    assert ev["backward_passes_per_step"] == 4 and ev["skippable_collectives_per_step"] == 6
    assert c["saving"]["method"] == "joint replay"
    # under-predicted on two ranks sharing one GPU (docs/findings.md, Validation): only a floor here
    assert c["saving"]["share"] > 0.08


@pytest.mark.skipif("underfilled" not in PAIRS, reason="the pair's H100 capture is not committed yet "
                    "(python3 bench/diagnosis/gpu_pairs.py underfilled)")
def test_underfilled_head_loop(reports):
    c = top(reports("underfilled"))
    assert c["code"] == "SM_ARRAY_IDLE" and c["evidence"]["source"] == "launch configuration"
    assert c["place"]["kind"] == "python" and "gpu_pairs" in c["place"]["name"]
    assert c["evidence"]["loop"] and c["evidence"]["repeats_per_call"] == 64 and "torch.bmm" in c["remedy"]
    assert within(c["saving"]["share"], PAIRS["underfilled"]["measured_share"])


def test_slow_transport_is_the_job_cause_priced_as_measured(reports):
    """NCCL over sockets on two NVLink H200s: the launches that blocked on the full launch queue
    are waiting, not host work, and the ranks replay in step however far behind the recording
    ran, so the fix (NVLink transfers) is priced at what the job measured."""
    c = top(reports("slow_transport2"))
    assert c["code"] == "SLOW_INTERCONNECT" and c["rank"] is None
    ev = c["evidence"]
    assert ev["busbw_gbps_best"] < 10 and ev["nvlink_busbw_gbps"] > 100 and ev["ranks"] == 2
    assert c["saving"]["method"] == "joint replay"
    assert within(c["saving"]["share"], PAIRS["slow_transport2"]["measured_share"])
