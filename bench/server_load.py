"""Load test of the central service on loopback: N simulated agents at once, real HTTP.

    .venv/bin/python bench/server_load.py [--agents 256] [--mb 1] [--deadline 180]

Starts ``aiprof server`` (127.0.0.1, a temporary DATA folder), then N agent threads of one job
each register, heartbeat, receive the job-wide capture command that one trigger sends, and
upload a random ``trace.json.gz`` of --mb MiB plus ``meta.json`` through the same client the
real agent uses (streamed, SHA-256 checked). At the end every file on the server is hashed and
compared with what its agent sent: every byte is accounted for. Prints requests/s, MB/s and
p50/p95/max latency per request kind, and the error count; exits 1 unless errors == 0 and all
bytes match. Bounded: --deadline seconds in all; every call has a timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from aiprof.server.client import ServerClient, ServerError, file_sha256  # noqa: E402

JOB = "load"


class Stats:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def timed(self, kind: str, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        except Exception as exc:
            with self.lock:
                self.errors.append(f"{kind}: {exc}")
            raise
        finally:
            with self.lock:
                self.lat[kind].append(time.perf_counter() - t0)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] if s else float("nan")


def agent(i: int, n: int, client: ServerClient, files: dict, st: Stats, go: threading.Event, deadline: float,
          uploads_per_file: dict) -> None:
    aid = f"sim-{i}"
    try:
        st.timed("register", client.post, "agents", {"agent_id": aid, "job": JOB, "host": f"node{i // 8}", "pid": 1000 + i,
                                                     "rank": i, "world_size": n, "steps": 10, "step_ms": 100.0})
        go.wait(max(0.0, deadline - time.monotonic()))
        steps = 10
        while time.monotonic() < deadline:
            steps += 5
            r = st.timed("heartbeat", client.post, f"agents/{aid}/heartbeat", {"steps": steps, "step_ms": 100.0})
            cmds = [c for c in r["commands"] if c.get("op") == "capture"]
            if cmds:
                cid = cmds[0]["capture_id"]
                for name in ("trace.json.gz", "meta.json"):
                    path, sha, size = files[i][name]
                    res = st.timed("upload", client.upload_file, cid, i, path, name, attempts=3, timeout=120,
                                   sha=(sha, size))
                    uploads_per_file[(i, name)] = res
                st.timed("result", client.post, f"agents/{aid}/results",
                         {"capture_id": cid, "rank": i, "ok": True, "phase": "captured"})
                return
            time.sleep(0.5)
        st.errors.append(f"agent {i}: no capture command before the deadline")
    except ServerError:
        pass  # counted in st.errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--mb", type=float, default=1.0, help="size of each agent's trace file (MiB)")
    ap.add_argument("--deadline", type=float, default=180.0, help="seconds for the whole run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = ap.parse_args()
    n = a.agents
    tmp = tempfile.mkdtemp(prefix="aiprof-load-")
    data = os.path.join(tmp, "data")
    srv = subprocess.Popen([sys.executable, "-m", "aiprof", "server", "--data", data, "--port", "0", "--host", "127.0.0.1"],
                           stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "server.log"), "wb"),
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        t_end = time.monotonic() + 30
        while not os.path.exists(os.path.join(data, "server.json")):
            if srv.poll() is not None or time.monotonic() > t_end:
                print(open(os.path.join(tmp, "server.log")).read(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        url = json.load(open(os.path.join(data, "server.json")))["url"]
        assert url.startswith("http://127.0.0.1:")
        token = open(os.path.join(data, "token")).read().strip()
        client = ServerClient(url, token, timeout=60.0)
        # the agents' files: random bytes (incompressible), hashed once here
        files: dict[int, dict[str, tuple[str, str, int]]] = {}
        size = int(a.mb * (1 << 20))
        for i in range(n):
            d = os.path.join(tmp, "agents", f"rank{i}")
            os.makedirs(d)
            for name, nbytes in (("trace.json.gz", size), ("meta.json", 256)):
                p = os.path.join(d, name)
                with open(p, "wb") as f:
                    f.write(os.urandom(nbytes))
                sha, sz = file_sha256(p)
                files[i] = files.get(i, {}) | {name: (p, sha, sz)}
        st = Stats()
        go = threading.Event()
        uploads: dict = {}
        deadline = time.monotonic() + a.deadline
        threads = [threading.Thread(target=agent, args=(i, n, client, files, st, go, deadline, uploads), daemon=True)
                   for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        while len(st.lat["register"]) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        t_reg = time.perf_counter() - t0
        go.set()
        trig = st.timed("trigger", client.post, f"jobs/{JOB}/captures",
                        {"request": {"iterations": 1}, "auto_analyze": False, "timeout_s": a.deadline})
        t1 = time.perf_counter()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        t_up = time.perf_counter() - t1
        cid = trig["capture_id"]
        state = None
        while time.monotonic() < deadline:
            state = client.get(f"captures/{cid}")
            if state["state"] != "capturing":
                break
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        # every byte accounted for: hash what the server stored and compare with what was sent
        mismatched, stored_bytes = [], 0
        for i in range(n):
            for name, (_, sha, sz) in files[i].items():
                p = os.path.join(data, "captures", cid, f"rank{i}", name)
                if not os.path.isfile(p) or file_sha256(p) != (sha, sz):
                    mismatched.append((i, name))
                else:
                    stored_bytes += sz
        sent_bytes = sum(sz for fs in files.values() for (_, _, sz) in fs.values())
        info = client.get("info")
        reqs = sum(len(v) for v in st.lat.values()) + sum(r.attempts for r in uploads.values())  # + status GETs
        print(f"aiprof server load test: {n} agents, {a.mb:g} MiB trace + 256 B meta each, loopback {url}")
        print(f"  registration of all agents: {t_reg:.2f} s; trigger -> all uploads done: {t_up:.2f} s; wall {wall:.2f} s")
        print(f"  capture {cid}: state {state and state['state']}, ranks received {len((state or {}).get('received') or [])}/{n}")
        for kind in ("register", "heartbeat", "trigger", "upload", "result"):
            xs = st.lat.get(kind, [])
            if xs:
                print(f"  {kind:9s} n={len(xs):5d}  p50 {pct(xs, 50) * 1e3:8.1f} ms  p95 {pct(xs, 95) * 1e3:8.1f} ms"
                      f"  max {max(xs) * 1e3:8.1f} ms")
        print(f"  HTTP requests ~{reqs} in {wall:.2f} s = {reqs / wall:.0f} req/s; upload phase {sent_bytes / t_up / 1e6:.1f} MB/s "
              f"({sent_bytes / 1e6:.1f} MB)")
        print(f"  bytes sent {sent_bytes}, stored and hash-verified {stored_bytes}, server counted {info['stats']['upload_bytes']}; "
              f"checksum mismatches seen by the server {info['stats']['checksum_mismatch']}")
        print(f"  errors = {len(st.errors)}, files missing or different = {len(mismatched)}")
        for e in st.errors[:10]:
            print("   ", e)
        ok = not st.errors and not mismatched and stored_bytes == sent_bytes == info["stats"]["upload_bytes"] \
            and state is not None and state["state"] == "uploaded"
        return 0 if ok else 1
    finally:
        srv.terminate()
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
