"""Issue 28 item 5: a straggler says what differs. Real CPU captures (tests/data/cpu_uneven,
`aiprof run --what python,shapes` of bench/diagnosis/cpu_uneven_ddp.py, 2 ranks over gloo):
rank 1's sequences are twice as long in ``uneven``, every rank's are the same in ``equal``. The
uneven job's straggler is named with its larger inputs (the op, both shapes) and told to even the
lengths; on the equal job no shape difference is claimed, whatever else the run shows.
The explanation's other kinds (a slower device, an extra host function, nothing that explains
the wait) are checked on the evidence dicts themselves."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from aiprof.analysis import rankdiff
from aiprof.analysis.ranks import diff_evidence
from aiprof.diagnosis.causes import straggler
from aiprof.pipeline import build_report
from aiprof.trace.store import open_capture

DATA = Path(__file__).resolve().parents[1] / "data" / "cpu_uneven"


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    out = {}
    for name in ("uneven", "equal"):
        d = tmp_path_factory.mktemp(name) / name
        shutil.copytree(DATA / name, d)  # the analysis caches next to the trace: not in the repo
        cap = open_capture(str(d))
        out[name] = (cap, build_report(cap))
    return out


def _stragglers(rep: dict) -> list[dict]:
    return [c for c in rep["causes"] + rep.get("minor", []) if c["code"] == "STRAGGLER"]


def test_uneven_straggler_is_named_with_its_larger_inputs(caps):
    _, rep = caps["uneven"]
    c = rep["causes"][0]
    assert c["code"] == "STRAGGLER" and c["rank"] == 1
    assert c["evidence"]["difference"]["kind"] == "inputs"
    # the input as it enters the model: the embedding of the token ids
    assert "rank 1's inputs are larger: aten::embedding gets [8, 256] on rank 1 vs [8, 128] on rank 0" in c["title"]
    assert "same sequence lengths" in c["remedy"] and "bucket or pad to a common length" in c["remedy"]
    assert "nvidia-smi" not in c["remedy"] and "logging" not in c["remedy"]  # no guess beyond the evidence
    sh = c["evidence"]["differs"]["shapes"]
    first = sh["first"]
    assert (first["op"], first["rank_shape"], first["base_shape"], first["ratio"]) == \
        ("aten::embedding", "[8, 256]", "[8, 128]", 2.0)
    assert (first["dim"], first["rank_size"], first["base_size"]) == (1, 256, 128)
    # the ops that carry the difference, largest first: every one on twice the elements
    assert sh["ops"] and all(o["ratio"] == 2.0 for o in sh["ops"])
    assert [o["delta_us"] for o in sh["ops"]] == sorted((o["delta_us"] for o in sh["ops"]), reverse=True)
    assert len(sh["ops"]) <= rankdiff.TOP and len(sh["edit"]) <= rankdiff.EDIT_MAX
    # what the larger inputs cost accounts for most of the wait rank 1 causes
    wait = c["evidence"]["straggler"]["caused_wait_per_step_us"]
    assert sh["larger_delta_us"] >= 0.5 * wait
    # the same model on both ranks: the gradients' all-reduces are the same size
    coll = c["evidence"]["differs"]["collectives"]
    assert coll["differ"] == [] and coll["unit"] == "elements" and coll["rank"]["AllReduce"]["calls"] == 2
    assert c["saving"]["per_step_us"] > 0 and c["saving"]["method"] == "joint replay"


def test_equal_shapes_claim_no_shape_difference(caps):
    cap, rep = caps["equal"]
    for base, slow in ((0, 1), (1, 0)):
        ev = diff_evidence(cap.rank(base), cap.rank(slow))
        assert ev["shapes"]["recorded"] and ev["shapes"]["groups"] == 0 and ev["shapes"]["first"] is None
        assert ev["collectives"]["differ"] == []
        assert ev["speed"]["device"] == "host" and ev["speed"]["signatures"] > 0
    # a straggler may still show (two ranks share two busy cores): never for its inputs
    for c in _stragglers(rep):
        assert c["evidence"]["difference"]["kind"] != "inputs" and "inputs are larger" not in c["title"]


def test_evidence_is_plain_json(caps):
    """Workers compute the evidence too (scale/tasks.py): it travels as plain data, unchanged."""
    cap, _ = caps["uneven"]
    ev = diff_evidence(cap.rank(0), cap.rank(1))
    assert json.loads(json.dumps(ev)) == ev


def test_shape_change_names_the_arguments_that_differ():
    ch = rankdiff.shape_change("[[2048, 128], [8, 512], [], []]", "[[2048, 128], [8, 1024], [], []]")
    assert (ch["base_shape"], ch["rank_shape"], ch["ratio"]) == ("[8, 512]", "[8, 1024]", 2.0)
    assert (ch["arg"], ch["dim"], ch["base_size"], ch["rank_size"]) == (1, 1, 512, 1024)
    two = rankdiff.shape_change("[[8, 512, 64], [8, 512, 64]]", "[[8, 1024, 64], [8, 1024, 64]]")
    assert two["rank_shape"] == "[8, 1024, 64], [8, 1024, 64]" and two["dim"] is None and two["ratio"] == 2.0
    assert rankdiff.numel([[262144]]) == 262144 and rankdiff.numel([]) == 0  # a TensorList; a scalar
    assert rankdiff.parse_dims("not json") == [] and rankdiff.parse_dims("") == []


def _ev(differs: dict, wait: float = 10_000.0, waiting: tuple = (0,)) -> dict:
    return {"straggler_rank": 2, "base_rank": 0, "caused_wait_per_step_us": wait, "waiting_ranks": list(waiting),
            "differs": {"kernels": [], "functions": [], **differs}}


def test_same_kernels_slower_on_the_same_inputs_is_a_slower_gpu():
    speed = {"device": "gpu", "signatures": 40, "rank_us": 30_000.0, "at_base_us": 22_000.0, "ratio": 30 / 22,
             "extra_us": 8_000.0, "top": []}
    clocks = {"sm_clock_mhz": {"rank": 1410.0, "base": 1980.0}}
    why = straggler.explain(_ev({"speed": speed, "clocks": clocks}, waiting=(0, 1, 3)))
    assert why["kind"] == "slower"
    assert why["text"] == ("rank 2 runs the same kernels on the same inputs 1.36× slower than rank 0 (the median "
                           "rank) (+8.0 ms per step); SM clock 1410 vs 1980 MHz")
    assert "GPU runs it slower" in why["remedy"] and "clocks, temperature" in why["remedy"]
    # within the run-to-run spread: not a slower GPU, and nothing else explains the wait
    speed = dict(speed, ratio=1.05, extra_us=1_000.0)
    assert straggler.explain(_ev({"speed": speed}))["kind"] == "unexplained"


def test_an_extra_host_function_is_named():
    fn = {"kind": "python", "name": "train.py(88): log_metrics", "delta_us": 6_000.0, "delta_calls": 1,
          "base_calls": 0}
    why = straggler.explain(_ev({"functions": [fn]}))
    assert why["kind"] == "extra host function"
    assert why["text"] == "it spends +6.0 ms per step in train.py(88): log_metrics, 1 more call"
    assert "train.py(88): log_metrics" in why["remedy"]
    # the same calls, only longer: not an extra function
    fn = dict(fn, delta_calls=0, base_calls=1)
    assert straggler.explain(_ev({"functions": [fn]}))["kind"] == "unexplained"


def test_nothing_that_explains_the_wait_is_said_plainly():
    coll = {"unit": "bytes", "differ": ["AllReduce"], "rank": {"AllReduce": {"calls": 3.0, "size": 3e6}},
            "base": {"AllReduce": {"calls": 2.0, "size": 2e6}}}
    why = straggler.explain(_ev({"shapes": {"recorded": False}, "collectives": coll}))
    assert why["kind"] == "unexplained"
    assert "AllReduce collectives: 3 calls of 3000000 bytes per step vs 2 of 2000000 on rank 0" in why["remedy"]
    assert "--what shapes" in why["remedy"]  # what would compare the inputs
    assert "logging" not in why["remedy"] and "nvidia-smi" not in why["remedy"]


def test_on_a_gpu_an_op_on_larger_inputs_carries_its_kernels_time(tmp_path):
    """The GPU path on a real H100 capture (tests/data/v3/healthy_fault) against a copy whose
    embedding got [8, 1024] token ids and whose gather kernels under it ran 500 µs longer: the
    difference is that op, on the GPU's clock; the rest is the same work at the same speed."""
    src = DATA.parent / "v3" / "healthy_fault" / "rank0"
    d = json.loads(gzip.decompress((src / "trace.json.gz").read_bytes()))
    ev = d["traceEvents"]
    emb = [e for e in ev if e.get("name") == "aten::embedding"]
    corr = {e["args"]["correlation"] for e in ev if e.get("cat") == "cuda_runtime"
            and any(e["tid"] == m["tid"] and m["ts"] <= e["ts"] <= m["ts"] + m["dur"] for m in emb)}
    for m in emb:
        m["args"]["Input Dims"][1] = [8, 1024]
    grown = [k for k in ev if k.get("cat") == "kernel" and k["args"].get("correlation") in corr]
    for k in grown:
        k["dur"] += 500.0
    for name, data in (("base", None), ("slow", d)):
        (tmp_path / name / "rank0").mkdir(parents=True)
        shutil.copy(src / "meta.json", tmp_path / name / "rank0")
        if data is None:
            shutil.copy(src / "trace.json.gz", tmp_path / name / "rank0")
        else:
            (tmp_path / name / "rank0" / "trace.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    base = open_capture(str(tmp_path / "base")).ranks[0]
    slow = open_capture(str(tmp_path / "slow")).ranks[0]
    ev = diff_evidence(base, slow)
    sh = ev["shapes"]
    assert sh["time"] == "gpu" and sh["groups"] == 1 and len(grown) == len(emb) == 3
    op = sh["ops"][0]
    assert sh["first"] == op and op["op"] == "aten::embedding" and (op["rank_shape"], op["base_shape"]) == \
        ("[8, 1024]", "[8, 512]")
    assert op["delta_us"] == pytest.approx(500.0 * len(grown) / len(emb), rel=1e-6)  # one step's kernels
    sp = ev["speed"]
    assert sp["device"] == "gpu" and sp["ratio"] == pytest.approx(1.0) and sp["extra_us"] == pytest.approx(0.0, abs=1e-6)
