"""Perfetto export decoded back with the perfetto package's protobuf classes."""
from __future__ import annotations

from collections import Counter

import numpy as np

from aiprof.export import perfetto
from aiprof.export import protobuf as pb
from aiprof.export.timeline import Mark
from aiprof.analysis.steps import find_steps
from tests.deps import need

p2 = need("perfetto.protos.perfetto.trace.perfetto_trace_pb2")


def _decode(path):
    trace = p2.Trace.FromString(open(path, "rb").read())
    tracks, procs, names = {}, {}, {}
    for pk in trace.packet:
        if pk.HasField("track_descriptor"):
            td = pk.track_descriptor
            if td.HasField("process"):
                procs[td.uuid] = td.process.process_name
            else:
                tracks[td.uuid] = (td.name, td.parent_uuid)
        if pk.HasField("interned_data"):
            names.update({e.iid: e.name for e in pk.interned_data.event_names})
    return trace, tracks, procs, names


def _slices(trace, tracks, names):
    """(track name, slice name, start, end) from begin/end pairs, checking that they nest."""
    open_: dict[int, list] = {}
    out = []
    for pk in trace.packet:
        if not pk.HasField("track_event"):
            continue
        te = pk.track_event
        if te.type == p2.TrackEvent.TYPE_SLICE_BEGIN:
            open_.setdefault(te.track_uuid, []).append((pk.timestamp, names[te.name_iid]))
        elif te.type == p2.TrackEvent.TYPE_SLICE_END:
            ts, name = open_[te.track_uuid].pop()
            assert pk.timestamp >= ts
            out.append((tracks[te.track_uuid][0], name, ts, pk.timestamp))
    assert not any(open_.values())
    return out


def test_decoded_perfetto_matches_the_store(gpt2_cap, tmp_path):
    rt = gpt2_cap.ranks[0]
    out = tmp_path / "t.pftrace"
    st = perfetto.export(gpt2_cap, str(out), marks=[Mark(0, int(rt.kernels["ts"][0]), int(rt.kernels["ts"][0]) + 5, "finding X")])
    trace, tracks, procs, names = _decode(out)
    assert list(procs.values())[0].startswith("rank 0")
    sl = _slices(trace, tracks, names)
    steps = find_steps(rt)
    host_ann = int((~rt.annotations["gpu"]).sum())
    want = (len(rt.ops) + len(rt.python) + len(rt.runtime) + host_ann + int(rt.annotations["gpu"].sum())
            + len(rt.kernels) + len(rt.memops) + len(steps) + 1)
    assert len(sl) == want == sum(st.slices.values())
    gpu = [s for s in sl if s[0].startswith("GPU") and "annotations" not in s[0]]
    assert len(gpu) == len(rt.kernels) + len(rt.memops)
    assert sum(e - s for _, _, s, e in gpu) == int(rt.kernels["dur"].sum()) + int(rt.memops["dur"].sum())
    # one track per stream, named by device and stream
    streams = {(int(d), int(s)) for d, s in zip(rt.kernels["device"], rt.kernels["stream"])}
    assert {f"GPU {d} stream {s}" for d, s in streams} <= {t for t, _ in tracks.values()}
    assert Counter(n for t, n, _, _ in sl if t == "steps") == Counter(f"step {n}" for n in steps.number.tolist())
    assert ("findings", "finding X") in {(t, n) for t, n, _, _ in sl}
    # the kernel names are the store's
    assert Counter(n for t, n, _, _ in gpu) == Counter(list(rt.kernels["name"]) + list(rt.memops["name"]))


def test_flows_link_launches_to_gpu_work_and_counters(gpt2_cap, tmp_path):
    out = tmp_path / "t.pftrace"
    perfetto.export(gpt2_cap, str(out))
    trace, tracks, _, _ = _decode(out)
    starts, ends, counters = [], [], Counter()
    for pk in trace.packet:
        if pk.HasField("track_event"):
            starts += list(pk.track_event.flow_ids)
            ends += list(pk.track_event.terminating_flow_ids)
            if pk.track_event.type == p2.TrackEvent.TYPE_COUNTER:
                counters[tracks[pk.track_event.track_uuid][0]] += 1
    rt = gpt2_cap.ranks[0]
    assert len(ends) == len(rt.kernels) + len(rt.memops)  # every GPU row's launch is in this trace
    assert set(ends) == set(starts)
    mem = rt.memory
    gpu_rows = int(((mem["device_type"] == 1) & (mem["total_allocated"] >= 0)).sum())
    assert counters["GPU 0 memory allocated"] == gpu_rows > 0


def test_two_ranks_are_two_processes(ddp2_cap, tmp_path):
    out = tmp_path / "d.pftrace"
    perfetto.export(ddp2_cap, str(out), host=False)
    trace, tracks, procs, names = _decode(out)
    assert sorted(n.split(" ")[1] for n in procs.values()) == ["0", "1"]
    by_proc = Counter(parent for _, parent in tracks.values())
    assert set(by_proc) == set(procs)
    sl = _slices(trace, tracks, names)
    assert len(sl) == sum(len(r.kernels) + len(r.memops) + len(find_steps(r)) + int(r.annotations["gpu"].sum())
                          for r in ddp2_cap.ranks)


def test_numpy_encoder_is_byte_identical_to_protobuf():
    rng = np.random.default_rng(1)
    n = 50
    ts = rng.integers(0, 2**62, n)
    track = rng.integers(1, 2**40, n)
    name = rng.integers(0, 300, n)
    value = rng.normal(size=n) * 1e9
    flow = np.where(rng.random(n) < 0.5, rng.integers(1, 2**63, n), 0)
    te = [pb.Field(9, pb.VARINT, np.full(n, 1, np.uint64)),
                       pb.Field(10, pb.VARINT, name.astype(np.uint64), name > 0),
                       pb.Field(11, pb.VARINT, track.astype(np.uint64)),
                       pb.Field(44, pb.FIXED64, pb.f64(value)),
                       pb.Field(47, pb.FIXED64, flow.astype(np.uint64), flow > 0)]
    pk = [pb.Field(8, pb.VARINT, pb.u64(ts)), pb.Field(11, pb.BYTES, sub=te)]
    buf, _ = pb.encode(n, [pb.Field(1, pb.BYTES, sub=pk)])
    want = p2.Trace()
    for i in range(n):
        p = want.packet.add()
        p.timestamp = int(ts[i])
        p.track_event.type = 1
        if name[i] > 0:
            p.track_event.name_iid = int(name[i])
        p.track_event.track_uuid = int(track[i])
        p.track_event.double_counter_value = float(value[i])
        if flow[i]:
            p.track_event.flow_ids.append(int(flow[i]))
    assert buf.tobytes() == want.SerializeToString()


def test_cli_export_carries_the_causes(gpt2_cap, tmp_path):
    """`aiprof export` puts each cause of the report on the rank's findings track, over its steps."""
    import subprocess
    import sys

    out = tmp_path / "f.pftrace"
    res = subprocess.run([sys.executable, "-m", "aiprof", "export", gpt2_cap.ranks[0].source, "-o", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    trace, tracks, procs, names = _decode(out)
    found = [(n, s, e) for t, n, s, e in _slices(trace, tracks, names) if t == "findings"]
    outlier = [x for x in found if "DATALOADER_STARVED" in x[0]]
    assert len(outlier) == 1 and "step 3" in outlier[0][0] and "saves" in outlier[0][0]
    steps = find_steps(gpt2_cap.ranks[0])
    i = list(steps.number).index(3)
    assert (outlier[0][1], outlier[0][2]) == (int(steps.start[i]), int(steps.end[i]))


def test_pm_counters_are_counter_tracks(tmp_path):
    """The GPU's PM samples (recorded on an H100, tests/data/pm) become one counter track per
    counter under the rank's process, with every sample's value at its window's start."""
    import importlib.util
    from pathlib import Path

    from aiprof.analysis.counters import load_pm
    from aiprof.trace.store import open_capture

    spec = importlib.util.spec_from_file_location(
        "pm_capture", Path(__file__).resolve().parents[1] / "analysis" / "test_counters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root, _ = mod.make_capture(tmp_path, mod._rec())
    cap = open_capture(str(root))
    out = tmp_path / "pm.pftrace"
    perfetto.export(cap, str(out))
    trace, tracks, procs, _ = _decode(out)
    got: dict[str, list] = {}
    for pk in trace.packet:
        if pk.HasField("track_event") and pk.track_event.type == p2.TrackEvent.TYPE_COUNTER:
            name, parent = tracks[pk.track_event.track_uuid]
            if name.startswith("gpu0 pm_"):
                assert parent in procs
                got.setdefault(name, []).append((pk.timestamp, pk.track_event.double_counter_value))
    pm = load_pm(cap.ranks[0])
    assert set(got) == {f"gpu0 {m}" for m in pm.values}
    sm = sorted(got["gpu0 pm_sm_active_pct"])
    assert len(sm) == len(pm) + 1  # one point per sample and one closing the last window
    assert [t for t, _ in sm[:-1]] == pm.t0.tolist()
    assert np.allclose([v for _, v in sm[:-1]], pm.values["pm_sm_active_pct"])
