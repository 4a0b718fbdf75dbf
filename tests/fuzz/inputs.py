"""Hypothesis strategies for hostile and unlucky trace files, and the one property they must hold.

The property (``check_cli``): ``aiprof analyze FILE`` ends in exactly one of two ways: exit 0
with a report on stdout and a complete store beside the input, or exit 2 with one line on stderr
that names the file, and no store (not even a temporary one). Never a traceback.

Shared by tests/fuzz/test_fuzz_inputs.py (a few hundred derandomized examples) and
bench/fuzz_inputs.py (a larger campaign that counts outcomes).
"""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import tempfile
import traceback
from dataclasses import dataclass, field

from hypothesis import strategies as st

from aiprof.cli.main import main as cli_main
from aiprof.trace.builder import TABLES

# --- the vocabulary of real traces, so that random events link up and reach deep analysis ---
NAMES = ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#x", "[memory]", "thread_name",
         "process_name", "process_labels", "aten::mm", "aten::addmm", "aten::to", "aten::copy_", "aten::item",
         "aten::_local_scalar_dense", "cudaLaunchKernel", "cudaDeviceSynchronize", "cudaStreamSynchronize",
         "cudaMemcpyAsync", "cuLaunchKernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclKernel_AllGather_RING_LL_Sum_int8_t",
         "ampere_sgemm_128x64_nn", "sm90_xmma_gemm_bf16bf16_bf16f32", "void at::native::elementwise_kernel<128, 4>",
         "Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pageable)", "Memset (Device)",
         "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "Optimizer.step#AdamW.step",
         "nccl:all_reduce", "record_param_comms", "train.py(10): step", "train.py(20): get_batch",
         "torch/utils/data/dataloader.py(700): __next__", "threading.py(1000): run", "threading.py(990): _bootstrap",
         "aiprof/agent/hwmon.py(10): loop", "<built-in function sleep>", "", "x" * 300, "naïve ✓ \n\t\"}],[{"]
ARG_KEYS = ["External id", "external id", "correlation", "correlation id", "device", "stream", "Python id",
            "Python parent id", "Python module id", "Bytes", "Total Allocated", "Total Reserved", "Addr", "Device Id",
            "Device Type", "Collective name", "In msg nelems", "Out msg nelems", "In msg size", "Out msg size",
            "Group size", "dtype", "Process Group Name", "Process Group Description", "Process Group Ranks", "Seq",
            "Sequence number", "Fwd thread id", "Input Dims", "Input dims", "Input type", "flops", "grid", "block",
            "registers per thread", "shared memory", "blocks per SM", "warps per SM", "est. achieved occupancy %",
            "queued", "bytes", "cbid", "wait_on_stream", "wait_on_cuda_event_record_corr_id", "name"]
STRINGS = ["allreduce", "all_gather", "reduce_scatter", "broadcast", "send", "Float", "BFloat16", "Half", "0",
           "default_pg", "[0, 1]", "[[2, 3], [3, 4]]", "", "\u0000", "\\", "}],"]

_STR_ARGS = ("Collective name", "dtype", "Process Group Name", "Process Group Description", "name")
_ANY_ARGS = ("Process Group Ranks", "Input Dims", "Input dims", "Input type")
_FLOAT_ARGS = ("flops", "blocks per SM", "warps per SM", "est. achieved occupancy %")

HUGE_INTS = [2**31, -(2**31) - 1, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**63, 2**64, -(2**63) - 1, 10**30]
HUGE_FLOATS = [1e15, 4.6e15, 4.7e15, -1.2e15, -1e16, 1e300, -1e300, 5e-324, 3.5e38, -3.5e38]

small_int = st.integers(-3, 40)  # ids that collide, so that links (correlation, External id, parents) form
any_int = st.one_of(small_int, st.integers(-(2**63), 2**63 - 1), st.sampled_from(HUGE_INTS))
any_float = st.one_of(st.floats(-1e3, 1e4, allow_nan=False), st.floats(allow_nan=False, allow_infinity=False),
                      st.sampled_from(HUGE_FLOATS))
json_leaf = st.one_of(st.none(), st.booleans(), any_int, any_float, st.sampled_from(STRINGS), st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.sampled_from(ARG_KEYS), inner, max_size=3)),
                        max_leaves=6)


_ARG_VALUE = {**{k: st.one_of(st.sampled_from(STRINGS), st.none()) for k in _STR_ARGS},
              **{k: json_any for k in _ANY_ARGS},
              **{k: st.one_of(st.floats(0, 1e6, allow_nan=False), st.none()) for k in _FLOAT_ARGS},
              "grid": st.lists(st.integers(0, 1024), max_size=3), "block": st.lists(st.integers(0, 1024), max_size=3)}
extreme = st.one_of(st.sampled_from(HUGE_INTS), st.sampled_from(HUGE_FLOATS), any_int, any_float)


def _value(good, hostile: bool):
    """A well-typed value in a sane range, or (hostile) often an extreme number or anything JSON holds."""
    return st.one_of(good, extreme, json_any) if hostile else good


# (ph, cat) of each kind of event torch.profiler writes; "B"/"C" ones aiprof does not read
KINDS = [("X", c) for c in ("cpu_op", "user_annotation", "gpu_user_annotation", "python_function", "cuda_runtime",
                            "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset", "cuda_sync")] + [
    ("i", "cpu_instant_event"), ("M", ""), ("s", "ac2g"), ("f", "ac2g"), ("s", "fwdbwd"), ("f", "fwdbwd"), ("B", ""),
    ("C", "")]
_NAME_OF = {"i": ["[memory]"], "M": ["thread_name", "process_name", "process_labels"]}


@st.composite
def event(draw, hostile: bool, kinds: tuple = tuple(KINDS)) -> dict:
    """One trace event. Well-formed: a (ph, cat) of ``kinds`` with every field it needs, values in
    sane ranges. Hostile: any field missing, extreme or of any JSON type."""
    ph, cat = draw(st.sampled_from(kinds))
    args = st.dictionaries(st.sampled_from(ARG_KEYS), st.none(), max_size=6).flatmap(
        lambda d: st.fixed_dictionaries({k: _ARG_VALUE.get(k, small_int) for k in d}))
    fields = {
        "ph": _value(st.just(ph), hostile),
        "cat": _value(st.just(cat), hostile),
        "name": _value(st.one_of(st.sampled_from(_NAME_OF.get(ph, NAMES)), st.text(max_size=12)), hostile),
        "pid": _value(st.one_of(small_int, st.sampled_from(["Spans", "Traces", "7"])), hostile),
        "tid": _value(st.one_of(small_int, st.sampled_from(["stream 7", "1"])), hostile),
        "ts": _value(st.one_of(st.floats(0, 2000, allow_nan=False), st.integers(0, 2000)), hostile),
        "dur": _value(st.one_of(st.floats(0, 500, allow_nan=False), st.integers(-5, 500)), hostile),
        "id": _value(st.one_of(small_int, st.text(max_size=3)), hostile),
        "args": _value(args, hostile),
    }
    present = {"id": 0.9 if ph in "sf" else 0.1, "args": 0.8}
    e: dict = {}
    for k, strat in fields.items():
        p = 0.85 if hostile else present.get(k, 1.0)
        if p >= 1.0 or draw(st.floats(0, 1)) < p:
            e[k] = draw(strat)
    return e


def _meta(hostile: bool):
    dev = st.fixed_dictionaries({}, optional={
        "id": _value(small_int, hostile), "name": _value(st.sampled_from(["NVIDIA H200", "NVIDIA H100 80GB HBM3", ""]), hostile),
        "numSms": _value(st.integers(0, 200), hostile), "totalGlobalMem": _value(st.integers(0, 2**40), hostile),
        "computeMajor": _value(st.integers(0, 10), hostile), "computeMinor": _value(st.integers(0, 10), hostile)})
    dist = st.fixed_dictionaries({}, optional={
        "rank": _value(st.integers(0, 3), hostile), "world_size": _value(st.integers(1, 4), hostile),
        "backend": _value(st.sampled_from(["nccl", "gloo"]), hostile)})
    return st.fixed_dictionaries({}, optional={
        "schemaVersion": _value(st.integers(0, 2), hostile),
        "deviceProperties": _value(st.lists(dev, max_size=2), hostile),
        "distributedInfo": _value(dist, hostile),
        "with_stack": _value(st.booleans(), hostile), "record_shapes": _value(st.booleans(), hostile),
        "profile_memory": _value(st.booleans(), hostile), "with_flops": _value(st.booleans(), hostile),
        "displayTimeUnit": _value(st.sampled_from(["ms", "ns"]), hostile),
        "cuda_runtime_version": _value(st.integers(0, 13000), hostile),
        "host_name": _value(st.text(max_size=5), hostile), "traceName": _value(st.text(max_size=5), hostile)})


def _kineto_layout(events: list, meta: dict | None) -> str:
    """torch.profiler's layout: one event per block at indent 2 (what the fast cuts rely on)."""
    body = ",\n".join("  {\n    " + json.dumps(e)[1:-1] + "\n  }" if isinstance(e, dict) and e else "  " + json.dumps(e)
                      for e in events)
    if meta is None:
        return "[\n" + body + "\n]\n"
    head = json.dumps(meta, indent=2)[:-2]
    return (head + ",\n" if meta else "{\n") + '  "traceEvents": [\n' + body + "\n  ]\n}\n"


@st.composite
def trace_file(draw, kinds: tuple = tuple(KINDS), hostile: bool | None = None) -> bytes:
    """A whole trace file's bytes: object or array format, compact/pretty/Kineto layout, maybe
    gzipped, and (hostile; drawn when None) maybe damaged."""
    meta_hostile = draw(st.booleans()) if hostile is None else hostile  # bad metadata around good events too
    hostile = draw(st.booleans()) if hostile is None else hostile
    events = draw(st.lists(event(hostile, kinds), max_size=40))
    if hostile and draw(st.booleans()):  # elements that are not even objects
        events.insert(draw(st.integers(0, len(events))), draw(json_any))
    array = draw(st.booleans())
    meta = None if array else draw(_meta(meta_hostile))
    layout = draw(st.sampled_from(["compact", "indent", "kineto"]))
    if layout == "kineto":
        text = _kineto_layout(events, meta)
    else:
        doc = events if array else {**meta, "traceEvents": events}
        text = json.dumps(doc, indent=2 if layout == "indent" else None, allow_nan=True)
    data = text.encode()
    if hostile and draw(st.integers(0, 9)) == 0:  # torn: the writer died mid-file
        data = data[: draw(st.integers(0, len(data)))]
    if hostile and draw(st.integers(0, 19)) == 0:  # deep nesting in place of an event
        depth = draw(st.sampled_from([10, 900, 5000, 100_000]))
        data = data.replace(b"[", b"[" + b"[" * depth + b"]" * depth + b",", 1) if b"[" in data else data
    if draw(st.integers(0, 3)) == 0:
        data = gzip.compress(data, compresslevel=1)
    return data


# --- the property ---
@dataclass
class Outcome:
    """What one run of ``aiprof analyze`` did."""

    kind: str  # "report" | "error" | "traceback" (any broken promise counts as one)
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    detail: str = ""
    tables: list[str] = field(default_factory=list)


def run_cli(path: str, *args: str) -> Outcome:
    """``aiprof analyze PATH`` in this process (the CLI's own code path), output captured."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["analyze", path, "--no-cache", *args])
    except BaseException as exc:  # noqa: BLE001 - what the user would see as a traceback
        return Outcome("traceback", 1, out.getvalue(), err.getvalue(), "".join(traceback.format_exception(exc)))
    return Outcome("report" if code == 0 else "error", code, out.getvalue(), err.getvalue())


def every_entry_point(cap) -> dict:
    """Run what the CLI verbs and the UI run over a capture (report as text and JSON, the UI's
    timeline, the Chrome export, the flame graphs); return the report."""
    from aiprof.analysis import timeline
    from aiprof.pipeline import build_report
    from aiprof.analysis.steps import window as steps_window
    from aiprof.export import chrome
    from aiprof.export.marks import marks_from_report
    from aiprof.export.timeline import build_timeline
    from aiprof.flame import stacks
    from aiprof.report import json_report, text

    report = build_report(cap)
    buf = io.StringIO()
    text.render(report, file=buf)
    assert buf.getvalue().startswith("aiprof report")
    json.loads(json_report.dumps(report))
    for rt in cap.ranks:
        idx = timeline.build_index(rt)
        timeline.lanes_info(idx)
        lo, hi = steps_window(rt)
        timeline.window(idx, lo, max(hi, lo + 1), 600)
    out = io.BytesIO()
    chrome.write(build_timeline(cap, marks=marks_from_report(report)), out)
    json.loads(out.getvalue())
    for what in ("gpu", "cpu"):
        stacks.build(cap, what)
    return report


def _stores(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".aiprof") or f.startswith(".tmp-"))


def _broken(o: Outcome, problems: list[str]) -> Outcome:
    return Outcome("traceback", o.exit_code, o.stdout, o.stderr, "; ".join(problems)) if problems else o


def check_cli(data: bytes, name: str = "trace.json", deep: bool = True) -> Outcome:
    """Write ``data`` as a trace file and analyse it (JSON, then text report; ``deep``: then every
    other entry point on its store); return the outcome, with kind "traceback" for any broken
    promise: a traceback, an error that is not one line naming the file with exit 2, a store left
    after an error, an incomplete store after a report."""
    with tempfile.TemporaryDirectory(prefix="aiprof-fuzz-") as d:
        path = os.path.join(d, name + (".gz" if data[:2] == b"\x1f\x8b" else ""))
        with open(path, "wb") as f:
            f.write(data)
        o = run_cli(path, "--json")
        if o.kind == "traceback":
            return o
        stores = _stores(d)
        problems = []
        if o.kind == "error":
            lines = o.stderr.strip().splitlines()
            if o.exit_code != 2:
                problems.append(f"exit code {o.exit_code}, not 2")
            if len(lines) != 1 or not lines[0].startswith("aiprof: error: ") or path not in lines[0]:
                problems.append(f"not one line naming the file: {o.stderr!r}")
            if stores:
                problems.append(f"left a store behind: {stores}")
            return _broken(o, problems)
        try:
            report = json.loads(o.stdout)
        except ValueError as exc:
            return _broken(o, [f"the JSON report does not parse: {exc}"])
        if stores != [os.path.basename(path) + ".aiprof"]:
            problems.append(f"the store is not one complete folder: {stores}")
        else:
            with open(os.path.join(d, stores[0], "meta.json")) as f:
                rows = json.load(f).get("rows", {})
            missing = [t for t in rows if not os.path.exists(os.path.join(d, stores[0], f"{t}.parquet"))]
            if missing:
                problems.append(f"the store lacks tables {missing}")
        ranks = report.get("ranks") or []
        if not ranks:
            problems.append("a report without ranks")
        else:
            o.tables = sorted(t for t in TABLES if ranks[0].get("rows", {}).get(t))
        text = run_cli(path)
        if text.kind != "report":
            problems.append(f"the text report failed ({text.kind}): {text.stderr[-500:]} {text.detail[-2000:]}")
        elif deep:
            from aiprof.trace.store import open_capture

            try:
                every_entry_point(open_capture(path))
            except Exception as exc:  # noqa: BLE001 - any exception here is a broken promise
                problems.append("an entry point failed: " + "".join(traceback.format_exception(exc))[-3000:])
        return _broken(o, problems)
