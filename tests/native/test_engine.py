"""The probe engine (Frida Interceptor + CModule) on real processes: counts, arguments, out-pointers,
the thread, the clock, libraries loaded after the attach, unhooking, bad probe files."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from aiprof.native.engine import EngineError, ProbeEngine, frida_status
from aiprof.native.probes import (HOT_SYMBOLS, ProbeError, decode_args, load_probe_file,
                                  parse_probes)

pytestmark = pytest.mark.skipif(not frida_status()[0], reason=f"Frida missing: {frida_status()[1]}")


def _frida_major() -> int:
    ok, ver = frida_status()
    return int(ver.split(".")[0]) if ok and ver.split(".")[0].isdigit() else 0


def _spec(extra_libs: list | None = None):
    return parse_probes({"libraries": [
        {"name": "nat", "library": "libnat.so*", "symbols": [
            {"symbol": "nat_add", "args": [{"index": 0, "name": "i", "type": "u64"},
                                           {"index": 6, "name": "g", "type": "u64"}]},
            {"symbol": "nat_alloc", "args": [{"index": 0, "name": "out", "type": "out_ptr"},
                                             {"index": 1, "name": "n", "type": "u64"}]},
            {"symbol": "nat_fail", "args": [{"index": 0, "name": "out", "type": "out_ptr"}]},
            {"symbol": "nat_absent", "args": []}]},
        *(extra_libs or [])]}, "test")


def _drain_until(eng: ProbeEngine, n: int, timeout: float = 30) -> np.ndarray:
    """Drain until ``n`` records arrived (the ring publishes each call when it returns)."""
    parts, got = [], 0
    deadline = time.monotonic() + timeout
    while got < n and time.monotonic() < deadline:
        r = eng.drain()
        parts.append(r)
        got += len(r)
    return np.concatenate(parts) if parts else np.zeros(0)


def test_every_call_with_its_arguments(driver):
    spec = _spec()
    ids = {s["symbol"]: s["id"] for s in spec.symbols}
    eng = ProbeEngine(driver.pid, spec)
    t_before = time.time_ns()
    try:
        eng.start()
        assert set(eng.hooked) == {"nat:nat_add", "nat:nat_alloc", "nat:nat_fail"}
        assert "nat:nat_absent" in eng.missing
        n = 500
        assert driver.cmd(f"add {n}").startswith("done")
        recs = _drain_until(eng, 2 * n + 1)
        t_after = time.time_ns()
    finally:
        eng.close()
    assert len(recs) == 2 * n + 1
    add = recs[recs["sym"] == ids["nat_add"]]
    alloc = recs[recs["sym"] == ids["nat_alloc"]]
    fail = recs[recs["sym"] == ids["nat_fail"]]
    assert (len(add), len(alloc), len(fail)) == (n, n, 1)
    # the first argument in a register, the 7th on the stack; the return value
    assert add["args"][:, 0].tolist() == list(range(n))
    assert set(add["args"][:, 6].tolist()) == {6}
    assert add["ret"].tolist() == [i + 21 for i in range(n)]
    # out-pointer read when the call returns: n % 64 bytes into one static array
    base = int(alloc["args"][0, 0])
    assert [int(a) - base for a in alloc["args"][:, 0]] == [i % 64 for i in range(n)]
    assert int(fail["args"][0, 0]) != 0 and int(fail["ret"][0]) == 7  # failed call: the pointer itself
    # the driver's only thread, wall-clock times in order, durations sane
    assert set(recs["tid"].tolist()) == {driver.pid}
    assert (recs["t0"] >= t_before).all() and (recs["t1"] <= t_after).all()
    assert (recs["t1"] >= recs["t0"]).all()
    dec = decode_args(spec.symbols[ids["nat_alloc"]], [int(x) for x in alloc["args"][3]])
    assert dec["n"] == 3 and dec["out"].startswith("0x")


@pytest.mark.skipif(_frida_major() < 17,
                    reason="Frida 16.7 does not list a library loaded after the attach (docs/capture.md)")
def test_library_loaded_after_attach_is_hooked_on_rescan(driver, native_bin):
    spec = _spec([{"name": "late", "library": "liblate.so", "symbols": [
        {"symbol": "late_mul", "args": [{"index": 0, "name": "a", "type": "u64"}]}]}])
    eng = ProbeEngine(driver.pid, spec)
    try:
        eng.start()
        assert "late:late_mul" not in eng.hooked  # not loaded yet
        assert driver.cmd(f"late {native_bin['late']} 0").startswith("done")
        # the sidecar's periodic scan: hooks the library once Frida has reported it (bounded wait)
        deadline = time.monotonic() + 20
        while "late:late_mul" not in eng.hooked and time.monotonic() < deadline:
            eng.scan()
            time.sleep(0.05)
        assert "late:late_mul" in eng.hooked
        assert driver.cmd(f"late {native_bin['late']} 40").startswith("done")
        recs = _drain_until(eng, 40)
    finally:
        eng.close()
    assert recs["args"][:, 0].tolist() == list(range(40))


def test_unhook_stops_recording_and_detach_leaves_process_running(driver):
    spec = _spec()
    eng = ProbeEngine(driver.pid, spec)
    try:
        eng.start()
        driver.cmd("add 10")
        assert len(_drain_until(eng, 21)) == 21
        assert eng.unhook("nat:nat_add")
        driver.cmd("add 10")
        recs = _drain_until(eng, 11)
        assert len(recs) == 11 and not (recs["sym"] == 0).any()
    finally:
        eng.close()
    assert driver.cmd("add 5").startswith("done")  # runs on untouched


def test_attach_to_a_dead_process_is_a_clear_error(native_bin):
    p = subprocess.Popen([str(native_bin["driver"])], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    p.wait(timeout=10)
    with pytest.raises(EngineError, match=f"cannot attach Frida to pid {p.pid}"):
        ProbeEngine(p.pid, _spec()).start()


def test_default_probe_file_loads():
    spec = load_probe_file("default")
    names = {s["symbol"] for s in spec.symbols}
    assert {"ncclAllReduce", "ncclGroupStart", "ncclGroupEnd", "ncclCommInitRank", "cudaMalloc",
            "cudaStreamSynchronize"} <= names
    assert not names & HOT_SYMBOLS
    ar = next(s for s in spec.symbols if s["symbol"] == "ncclAllReduce")
    # ncclAllReduce(sendbuff, recvbuff, count, datatype=bfloat16(9), op=sum, comm, stream)
    d = decode_args(ar, [0, 0, 1000, 9, 0, 0x55, 0x66, 0])
    assert d == {"count": 1000, "datatype": "bfloat16", "op": "sum", "comm": "0x55", "stream": "0x66", "bytes": 2000}
    assert spec.engine_config()[0]["symbols"][0]["nargs"] == 7


@pytest.mark.parametrize("body, why", [
    ("{", "not valid JSON"),
    ('{"libraries": []}', "at least one library"),
    ('{"libraries": [{"name": "x", "library": "libx.so", "symbols": [{"symbol": "cudaLaunchKernel"}]}]}',
     "called too often"),
    ('{"libraries": [{"name": "x", "library": "libx.so", "symbols": [{"symbol": "f", "args": '
     '[{"index": 9, "name": "a"}]}]}]}', "integer 0..7"),
    ('{"libraries": [{"name": "x", "library": "libx.so", "symbols": [{"symbol": "f", "args": '
     '[{"index": 0, "name": "a", "type": "float128"}]}]}]}', "unknown type"),
    ('{"libraries": [{"name": "x", "library": "/abs/libx.so", "symbols": [{"symbol": "f"}]}]}', "file-name glob"),
])
def test_bad_probe_files_are_one_line_errors(tmp_path, body, why):
    p = tmp_path / "probe.json"
    p.write_text(body)
    with pytest.raises(ProbeError, match=why) as ei:
        load_probe_file(str(p))
    assert "\n" not in str(ei.value) and str(p) in str(ei.value)


def test_cli_bad_probe_file_exits_nonzero_without_traceback(tmp_path):
    p = tmp_path / "probe.json"
    p.write_text('{"libraries": 3}')
    r = subprocess.run([sys.executable, "-m", "aiprof", "run", "--probe-file", str(p), "--iterations", "1",
                        "--", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "probe file" in lines[0] and "libraries" in lines[0]
