"""Load test of the central service on loopback: N simulated agents in light processes, real HTTP.

    .venv/bin/python bench/server_load.py [--agents 1024] [--procs 32] [--mb 0.25] [--deadline 300]
    .venv/bin/python bench/server_load.py --baseline main --runs 3    # side by side with main's server

Starts ``aiprof server`` (127.0.0.1, a temporary DATA folder), then --procs child processes
that each run their share of the N agents of one job (an agent is a thread of its child: a light
process holds N/P of them, as a node holds its ranks). Every agent does what the real agent's
uplink does (agent/uplink.py), through the same client (server/client.py):

1. registers, then heartbeats at the interval the server asks for (it stretches it for big fleets);
2. a job-wide capture trigger reaches it in a heartbeat's answer; it uploads a random
   ``trace.json.gz`` of --mb MiB plus ``meta.json`` (streamed, SHA-256 checked) and reports;
3. a job-wide hang snapshot reaches it the same way; it posts its stacks and last collectives
   in the agent's format. One rank (N - 3) is stuck in its data loader, one all-reduce behind
   the others, who wait in that all-reduce: the server's analysis must name exactly that rank.
4. the snapshot's own cost, without the fan-out: a second snapshot whose N stacks the bench
   posts itself, 16 at a time; from the first post to the snapshot analysed.

Then every file on the server is hashed and compared with what its agent sent. Prints
registration time, trigger fan-out time (trigger sent -> the last agent has the command, on the
machine's monotonic clock, shared by all processes), the upload phase's MB/s and where the
machine's CPU went meanwhile (the server, the load generator, every other process), the hang
snapshot's times (fan-out, the server's own account of its arrivals and of the assembly after
the last), latency per request kind, and the error count; exits 1 unless nothing was lost, every
byte matches and the hang outlier is the stuck rank. Bounded: --deadline seconds per run; every
call has a timeout.

--baseline REV (repeatable) runs the same load against git revision REV's server and client
(its src/ extracted with git archive), alternating with this tree's --runs times, and prints a
table of medians (min-max) with this tree / the first baseline.
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SRC = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
# a baseline run's agents import that revision's client (code_env)
sys.path.insert(0, os.environ.get("AIPROF_BENCH_SRC") or SRC)

from aiprof.server.client import ServerClient, ServerError, file_sha256  # noqa: E402

JOB = "load"
POLL_S = 0.05  # how often the parent looks at its children's reports
STATE_POLL_S = 0.5  # how often it asks the server for the capture's state (each answer lists every rank)
HANG_PG_SIZE_SEQ = 7  # the all-reduce the waiting ranks sit in (the stuck rank is at seq 6)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] if s else float("nan")


def stuck_rank(n: int) -> int:
    """The rank that the hang snapshot must name (not the first or last: no edge effects)."""
    return max(0, n - 3)


def stack_dump(rank: int, n: int) -> dict[str, Any]:
    """A rank's hang snapshot in the agent's format (uplink._stacks): main thread + last collectives."""
    stuck = rank == stuck_rank(n)
    inner = ([{"function": "load_batch", "file": "/job/data.py", "line": 41, "native": False},
              {"function": "train_step", "file": "/job/train.py", "line": 88, "native": False}] if stuck else
             [{"function": "all_reduce", "file": "/usr/lib/python3/torch/distributed/distributed_c10d.py", "line": 2800,
               "native": False},
              {"function": "train_step", "file": "/job/train.py", "line": 95, "native": False}])
    frames = inner + [{"function": "main", "file": "/job/train.py", "line": 120, "native": False},
                      {"function": "<module>", "file": "/job/train.py", "line": 130, "native": False}]
    last = HANG_PG_SIZE_SEQ - 1 if stuck else HANG_PG_SIZE_SEQ

    def in_flight(seq: int) -> bool:  # the waiting ranks sit in their last all-reduce; the stuck one left its own
        return seq == last and not stuck
    colls = [{"seq": s, "op": "all_reduce", "pg": "0", "pg_size": n, "shape": [1024], "dtype": "float32",
              "t_ns": 1_700_000_000_000_000_000 + s * 1_000_000,
              "returned_ns": None if in_flight(s) else 1_700_000_000_000_000_000 + s * 1_000_000 + 500_000,
              "state": "entered" if in_flight(s) else "returned", "p2p": False, "peer": None}
             for s in range(1, last + 1)]
    return {"pid": 10_000 + rank, "host": f"node{rank // 8}", "ok": True, "error": None, "native": False,
            "threads": [{"thread_id": 1, "os_thread_id": 10_000 + rank, "name": "MainThread", "active": True,
                         "owns_gil": True, "frames": frames}],
            "last_collectives": {"installed": True, "python": colls, "flight_recorder": None, "fr_error": None},
            "steps": 40, "last_step_age_s": 30.0}


# -- child: a light process holding its share of the agents ----------------------------------------
class Child:
    """One child process: agents ``ranks`` as threads; reports events as JSON lines on stdout."""

    def __init__(self, url: str, token: str, n: int, ranks: list[int], files: dict[str, Any], deadline: float) -> None:
        try:  # as the agent's uplink makes it (agent/uplink.py): a baseline revision's may not keep connections
            self.client = ServerClient(url, token, timeout=60.0, keep_alive=True)
        except TypeError:
            self.client = ServerClient(url, token, timeout=60.0)
        self.n, self.ranks, self.files, self.deadline = n, ranks, files, deadline
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.lock = threading.Lock()

    def emit(self, **ev: Any) -> None:
        with self.lock:
            sys.stdout.write(json.dumps(ev) + "\n")
            sys.stdout.flush()

    def timed(self, kind: str, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            with self.lock:
                self.lat[kind].append(time.perf_counter() - t0)

    def agent(self, i: int) -> None:
        aid = f"sim-{i}"
        try:
            r = self.timed("register", self.client.post, "agents",
                           {"agent_id": aid, "job": JOB, "host": f"node{i // 8}", "pid": 10_000 + i, "rank": i,
                            "world_size": self.n, "steps": 10, "step_ms": 100.0})
            self.emit(ev="registered", rank=i, t=time.monotonic())
            interval = float(r.get("interval_s") or 1.0)
            steps, captured = 10, False
            while time.monotonic() < self.deadline:
                steps += 5
                r = self.timed("heartbeat", self.client.post, f"agents/{aid}/heartbeat", {"steps": steps, "step_ms": 100.0})
                interval = float(r.get("interval_s") or interval)
                for cmd in r.get("commands") or []:
                    self.emit(ev="command", op=cmd.get("op"), rank=i, t=time.monotonic())
                    if cmd.get("op") == "capture" and not captured:
                        # on its own thread, as the agent's upload loop: heartbeats go on meanwhile
                        threading.Thread(target=self.capture, args=(i, cmd["capture_id"]), daemon=True).start()
                        captured = True
                    elif cmd.get("op") == "stacks":
                        self.timed("stacks", self.client.post, f"hang/{cmd['snapshot_id']}/ranks/{i}",
                                   stack_dump(i, self.n), timeout=15.0)
                        self.emit(ev="stacks_sent", rank=i, t=time.monotonic())
                        return
                time.sleep(interval)
            self.emit(ev="error", msg=f"agent {i}: no hang command before the deadline")
        except (ServerError, OSError) as exc:
            self.emit(ev="error", msg=f"agent {i}: {type(exc).__name__}: {exc}")

    def capture(self, i: int, cid: str) -> None:
        try:
            self._upload(i, cid)
        except (ServerError, OSError) as exc:
            self.emit(ev="error", msg=f"agent {i} upload: {type(exc).__name__}: {exc}")

    def _upload(self, i: int, cid: str) -> None:
        for name in ("trace.json.gz", "meta.json"):
            path, sha, size = self.files[str(i)][name]
            res = self.timed("upload", self.client.upload_file, cid, i, path, name, attempts=3, timeout=120,
                             sha=(sha, size))
            self.emit(ev="uploaded", rank=i, name=name, attempts=res.attempts, t=time.monotonic())
        self.timed("result", self.client.post, f"agents/sim-{i}/results",
                   {"capture_id": cid, "rank": i, "ok": True, "phase": "captured"})

    def run(self) -> None:
        threads = [threading.Thread(target=self.agent, args=(i,), daemon=True) for i in self.ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, self.deadline - time.monotonic()))
        self.emit(ev="latencies", lat=self.lat)


def child_main(spec_path: str) -> int:
    spec = json.load(open(spec_path))
    Child(spec["url"], spec["token"], spec["n"], spec["ranks"], spec["files"], spec["deadline"]).run()
    return 0


# -- parent -----------------------------------------------------------------------------------------
class Reports:
    """What the children said, read on background threads (one per child's stdout)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, dict[int, float]] = defaultdict(dict)  # kind -> rank -> monotonic time
        self.uploads: list[dict] = []
        self.errors: list[str] = []
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.children_done = 0

    def read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                kind = ev.get("ev")
                if kind == "command":
                    self.events[f"command:{ev['op']}"].setdefault(ev["rank"], ev["t"])
                elif kind in ("registered", "stacks_sent"):
                    self.events[kind][ev["rank"]] = ev["t"]
                elif kind == "uploaded":
                    self.uploads.append(ev)
                elif kind == "error":
                    self.errors.append(ev["msg"])
                elif kind == "latencies":
                    for k, xs in ev["lat"].items():
                        self.lat[k].extend(xs)
        with self.lock:
            self.children_done += 1

    def count_uploads(self) -> int:
        with self.lock:
            return len(self.uploads)

    def last_upload(self) -> float:
        with self.lock:
            return max((u["t"] for u in self.uploads), default=float("nan"))

    def count(self, kind: str) -> int:
        with self.lock:
            return len(self.events[kind])

    def first(self, kind: str) -> float:
        with self.lock:
            return min(self.events[kind].values(), default=float("nan"))

    def last(self, kind: str) -> float:
        with self.lock:
            return max(self.events[kind].values(), default=float("nan"))


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def proc_peak_rss_mb(pid: int) -> float:
    """A live process's peak resident memory (VmHWM), MB; nan once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


def machine_cpu_s() -> float:
    """CPU seconds every process of this machine has used so far (all cores, not idle or iowait)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuMeter:
    """Where a phase's CPU went: the server, the load generator (parent and children), everything else."""

    def __init__(self, server: int, children: list[int]) -> None:
        self.server, self.children = server, children
        self.t0 = self.take()

    def take(self) -> tuple[float, float, float, float]:
        own = os.times()
        return (time.monotonic(), proc_cpu_s(self.server), sum(proc_cpu_s(p) for p in self.children)
                + own.user + own.system, machine_cpu_s())

    def since(self, t0: tuple[float, float, float, float]) -> dict[str, float]:
        t1 = self.take()
        wall, srv, load, total = (b - a for a, b in zip(t0, t1))
        return {"wall_s": wall, "server_cpu_s": srv, "clients_cpu_s": load, "other_cpu_s": max(0.0, total - srv - load),
                "cores": os.cpu_count() or 1}


def wait_for(cond, deadline: float, poll: float = POLL_S) -> bool:
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def make_files(tmp: str, n: int, mb: float) -> dict[str, dict[str, tuple[str, str, int]]]:
    """Each agent's upload: random bytes (incompressible), hashed once here."""
    files: dict[str, dict[str, tuple[str, str, int]]] = {}
    size = int(mb * (1 << 20))
    for i in range(n):
        d = os.path.join(tmp, "agents", f"rank{i}")
        os.makedirs(d)
        for name, nbytes in (("trace.json.gz", size), ("meta.json", 256)):
            p = os.path.join(d, name)
            with open(p, "wb") as f:
                f.write(os.urandom(nbytes))
            sha, sz = file_sha256(p)
            files.setdefault(str(i), {})[name] = (p, sha, sz)
    return files


def start_server(tmp: str, agents: int, env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    data = os.path.join(tmp, "data")
    # every simulated agent registers from 127.0.0.1: the per-address bound (256 by default) is lifted
    srv = subprocess.Popen([sys.executable, "-m", "aiprof", "server", "--data", data, "--port", "0", "--host", "127.0.0.1",
                            "--max-agents-per-host", str(max(agents, 1))],
                           stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "server.log"), "wb"), env=env)
    if not wait_for(lambda: os.path.exists(os.path.join(data, "server.json")) or srv.poll() is not None,
                    time.monotonic() + 60) or srv.poll() is not None:
        srv.kill()
        raise SystemExit("the server did not start:\n" + open(os.path.join(tmp, "server.log")).read())
    url = json.load(open(os.path.join(data, "server.json")))["url"]
    token = open(os.path.join(data, "token")).read().strip()
    return srv, url, token


def code_env(src: str | None) -> dict[str, str]:
    """The environment of the server and the agents' processes: this tree's code, or ``src``'s
    (a baseline revision's src/ folder): the same load on another revision's server and client."""
    if src is None:
        return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    rest = [p for p in sys.path if os.path.abspath(p) != os.path.abspath(SRC)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, *rest]), AIPROF_BENCH_SRC=src)


def checkout(rev: str, into: str) -> tuple[str, str]:
    """``rev``'s src/ folder extracted under ``into`` (git archive of this repository): (path, short sha)."""
    repo = os.path.dirname(SRC)
    sha = subprocess.run(["git", "-C", repo, "rev-parse", "--short", rev], capture_output=True, text=True)
    if sha.returncode != 0:
        raise SystemExit(f"--baseline {rev}: not a revision of {repo}: {sha.stderr.strip()}")
    dest = os.path.join(into, f"rev-{sha.stdout.strip()}")
    os.makedirs(dest, exist_ok=True)
    arc = subprocess.Popen(["git", "-C", repo, "archive", sha.stdout.strip(), "src"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=arc.stdout, check=True)
    if arc.wait() != 0:
        raise SystemExit(f"--baseline {rev}: git archive failed")
    return os.path.join(dest, "src"), sha.stdout.strip()


ASM_THREADS = 16  # the bench's own posts of a snapshot's stacks, at a time


def wait_analysed(client: Any, sid: str, deadline: float) -> dict:
    """Poll hang snapshot ``sid`` until it is analysed (or failed); its last state."""
    st: dict = {}

    def analysed() -> bool:
        nonlocal st
        st = client.get(f"hang/{sid}")
        return st.get("state") in ("analysed", "failed")
    wait_for(analysed, deadline)
    return st


def assemble_snapshot(url: str, token: str, client: ServerClient, n: int, meter: CpuMeter,
                      deadline: float) -> dict[str, Any]:
    """A snapshot's own cost, without the command's fan-out through heartbeats: a second job-wide
    snapshot (its agents still count as alive), whose N stacks the bench posts itself at once,
    ASM_THREADS at a time; from the first post to the snapshot analysed, and the server's CPU."""
    try:
        poster = ServerClient(url, token, timeout=60.0, keep_alive=True)
    except TypeError:  # a baseline revision's client
        poster = ServerClient(url, token, timeout=60.0)
    c0 = meter.take()
    try:
        hang = client.post(f"jobs/{JOB}/hang", {"timeout_s": 120.0})
    except ServerError as exc:
        return {"error": f"no second snapshot: {exc}"}
    sid, ranks = hang["snapshot_id"], hang["ranks"]
    t0 = time.monotonic()
    with ThreadPoolExecutor(ASM_THREADS) as ex:
        list(ex.map(lambda r: poster.post(f"hang/{sid}/ranks/{r}", stack_dump(r, n), timeout=30.0), ranks))
    posted = time.monotonic() - t0
    st = wait_analysed(client, sid, deadline)
    assembled = time.monotonic() - t0
    cpu = meter.since(c0)
    outliers = sorted(o.get("rank") for o in (st.get("result") or {}).get("outliers") or [])
    return {"ranks": len(ranks), "posted_s": round(posted, 3), "assembled_s": round(assembled, 3),
            "server_cpu_s": round(cpu["server_cpu_s"], 3), "outliers": outliers}


def run_once(a: argparse.Namespace, src: str | None, label: str) -> dict[str, Any]:
    """One load test against the server (and client) of ``src`` (None: this tree); prints its
    report and returns its figures (RESULT line)."""
    n, procs = a.agents, max(1, min(a.procs, a.agents))
    env = code_env(src)
    tmp = tempfile.mkdtemp(prefix="aiprof-load-")
    srv, url, token = start_server(tmp, n, env)
    children: list[subprocess.Popen] = []
    try:
        client = ServerClient(url, token, timeout=60.0)
        files = make_files(tmp, n, a.mb)
        deadline = time.monotonic() + a.deadline
        rep = Reports()
        t0 = time.monotonic()
        for c in range(procs):
            spec = os.path.join(tmp, f"child{c}.json")
            json.dump({"url": url, "token": token, "n": n, "ranks": list(range(c, n, procs)), "deadline": deadline,
                       "files": {str(i): files[str(i)] for i in range(c, n, procs)}}, open(spec, "w"))
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", spec], stdout=subprocess.PIPE,
                                 text=True, env=env)
            children.append(p)
            threading.Thread(target=rep.read, args=(p,), daemon=True).start()
        registered = wait_for(lambda: rep.count("registered") >= n, deadline)
        t_reg = rep.last("registered") - t0
        meter = CpuMeter(srv.pid, [p.pid for p in children])
        # 1. a job-wide capture
        c_trig = meter.take()
        t_trig = time.monotonic()
        trig = client.post(f"jobs/{JOB}/captures", {"request": {"iterations": 1}, "auto_analyze": False,
                                                   "timeout_s": a.deadline})
        cid = trig["capture_id"]
        wait_for(lambda: rep.count("command:capture") >= n, deadline)
        t_fan = rep.last("command:capture") - t_trig
        # the uploads end with the last file the server accepted (the agents say when: the capture
        # turns "uploaded" within that answer); the server is not polled meanwhile, so that the
        # bench adds no load of its own to the phase it measures
        wait_for(lambda: rep.count_uploads() >= 2 * n or bool(rep.errors), deadline)
        t_up = rep.last_upload() - t_trig
        t_window = rep.last_upload() - rep.first("command:capture")  # the first agent told -> the last file in
        up_cpu = meter.since(c_trig)
        state = None

        def uploaded() -> bool:
            nonlocal state
            state = client.get(f"captures/{cid}")
            return state["state"] != "capturing"
        wait_for(uploaded, deadline, poll=STATE_POLL_S)
        # 2. a job-wide hang snapshot, while every agent still heartbeats
        c_hang = meter.take()
        t_hang = time.monotonic()
        hang = client.post(f"jobs/{JOB}/hang", {"timeout_s": min(300.0, max(2.0, deadline - time.monotonic()))})
        sid = hang["snapshot_id"]
        hang_ranks = len(hang["ranks"])  # the agents alive when it was sent
        wait_for(lambda: rep.count("command:stacks") >= hang_ranks, deadline)
        t_hang_fan = rep.last("command:stacks") - t_hang
        hang_state = wait_analysed(client, sid, deadline)
        t_hang_done = time.monotonic() - t_hang
        hang_cpu = meter.since(c_hang)
        asm = assemble_snapshot(url, token, client, n, meter, deadline)
        for p in children:
            p.wait(max(1.0, deadline - time.monotonic()))
        wait_for(lambda: rep.children_done >= procs, time.monotonic() + 10)
        # every byte accounted for: hash what the server stored and compare with what was sent
        data = os.path.join(tmp, "data")
        mismatched, stored_bytes = [], 0
        for i in range(n):
            for name, (_, sha, sz) in files[str(i)].items():
                p = os.path.join(data, "captures", cid, f"rank{i}", name)
                if not os.path.isfile(p) or file_sha256(p) != (sha, sz):
                    mismatched.append((i, name))
                else:
                    stored_bytes += sz
        sent_bytes = sum(sz for fs in files.values() for (_, _, sz) in fs.values())
        info = client.get("info")
        result = hang_state.get("result") or {}
        outliers = sorted(o.get("rank") for o in result.get("outliers") or [])
        timing = hang_state.get("timing") or {}  # the server's own account (this tree's server)
        arrivals = (timing["last_arrival"] - timing["first_arrival"]) if timing.get("last_arrival") else None
        print(f"[{label}] aiprof server load test: {n} agents in {procs} processes, {a.mb:g} MiB trace + 256 B meta "
              f"each, loopback {url}")
        print(f"  registration of all agents: {t_reg:.2f} s ({rep.count('registered')}/{n}); heartbeat interval told "
              f"{max(1.0, n / 500.0):.2f} s")
        print(f"  capture trigger -> every agent has it: {t_fan:.2f} s ({rep.count('command:capture')}/{n}); "
              f"-> all uploads done: {t_up:.2f} s; state {state and state['state']}, ranks received "
              f"{len((state or {}).get('received') or [])}/{n}")
        sent_mb = sent_bytes / 1e6
        print(f"  upload phase: {2 * n} files, {sent_mb:.1f} MB in {t_up:.2f} s = {sent_mb / t_up:.1f} MB/s from the "
              f"trigger (the command's fan-out included); {t_window:.2f} s = {sent_mb / t_window:.1f} MB/s from the "
              f"first agent's command to the last file")
        print(f"  upload phase CPU: server {up_cpu['server_cpu_s']:.1f} s ({up_cpu['server_cpu_s'] / up_cpu['wall_s']:.0%} "
              f"of a core), load generator {up_cpu['clients_cpu_s']:.1f} s, other processes {up_cpu['other_cpu_s']:.1f} s, "
              f"of {up_cpu['cores']} cores x {up_cpu['wall_s']:.1f} s = {up_cpu['cores'] * up_cpu['wall_s']:.1f} s")
        print(f"  hang trigger -> every agent has it: {t_hang_fan:.2f} s ({rep.count('command:stacks')}/{n}, "
              f"{hang_ranks} alive when sent); -> snapshot {hang_state.get('state')}: {t_hang_done:.2f} s; "
              f"{len(result.get('processes') or [])} processes, outliers {outliers} (stuck rank {stuck_rank(n)})")
        print(f"  hang snapshot at the server: " + (
            f"{hang_ranks} arrivals over {arrivals:.2f} s, assembled {timing['assembled_s'] * 1e3:.0f} ms after the last "
            f"({timing.get('kept_in_memory')} stacks from memory, {timing.get('read_back')} read back)"
            if arrivals is not None else "no timing recorded (a server before the snapshot kept its arrivals)")
            + f"; server CPU in the hang phase {hang_cpu['server_cpu_s']:.2f} s of {hang_cpu['wall_s']:.2f} s")
        if asm.get("error"):
            print(f"  hang assembly: {asm['error']}")
        else:
            print(f"  hang assembly (a second snapshot, {asm['ranks']} stacks posted by the bench, {ASM_THREADS} at a "
                  f"time): all posted in {asm['posted_s']:.2f} s, analysed {asm['assembled_s']:.2f} s after the first; "
                  f"server CPU {asm['server_cpu_s']:.2f} s; outliers {asm['outliers']}")
        for kind in ("register", "heartbeat", "upload", "result", "stacks"):
            xs = rep.lat.get(kind, [])
            if xs:
                print(f"  {kind:9s} n={len(xs):5d}  p50 {pct(xs, 50) * 1e3:8.1f} ms  p95 {pct(xs, 95) * 1e3:8.1f} ms"
                      f"  max {max(xs) * 1e3:8.1f} ms")
        peak = info["stats"].get("upload_buffered_peak")
        print(f"  server memory: peak RSS {proc_peak_rss_mb(srv.pid):.0f} MB" +
              (f"; upload bytes waiting to be written, at most {peak / 2**20:.1f} MiB" if peak is not None else ""))
        print(f"  bytes sent {sent_bytes}, stored and hash-verified {stored_bytes}, server counted "
              f"{info['stats']['upload_bytes']}; checksum mismatches seen by the server {info['stats']['checksum_mismatch']}")
        print(f"  errors = {len(rep.errors)}, files missing or different = {len(mismatched)}")
        for e in rep.errors[:10]:
            print("   ", e)
        ok = (registered and not rep.errors and not mismatched and stored_bytes == sent_bytes == info["stats"]["upload_bytes"]
              and state is not None and state["state"] == "uploaded" and hang_ranks == n and outliers == [stuck_rank(n)]
              and asm.get("outliers") == [stuck_rank(n)])
        print("  OK" if ok else "  FAILED")
        st = {k: sorted(v) for k, v in rep.lat.items()}
        res = {"label": label, "agents": n, "ok": ok, "upload_s": round(t_up, 3), "upload_mb_s": round(sent_mb / t_up, 2),
               "upload_window_s": round(t_window, 3), "upload_window_mb_s": round(sent_mb / t_window, 2),
               **{f"upload_{k}": round(v, 2) for k, v in up_cpu.items()},
               "hang_fanout_s": round(t_hang_fan, 3), "hang_s": round(t_hang_done, 3),
               "hang_server_cpu_s": round(hang_cpu["server_cpu_s"], 3),
               "hang_arrivals_s": None if arrivals is None else round(arrivals, 3),
               "hang_assembled_s": timing.get("assembled_s"),
               "server_peak_rss_mb": round(proc_peak_rss_mb(srv.pid), 1), "upload_buffered_peak": peak,
               "asm_posted_s": asm.get("posted_s"), "asm_assembled_s": asm.get("assembled_s"),
               "asm_server_cpu_s": asm.get("server_cpu_s"),
               "stacks_p50_ms": round(pct(st.get("stacks", []), 50) * 1e3, 1),
               "stacks_p95_ms": round(pct(st.get("stacks", []), 95) * 1e3, 1),
               "upload_p50_ms": round(pct(st.get("upload", []), 50) * 1e3, 1),
               "heartbeat_p95_ms": round(pct(st.get("heartbeat", []), 95) * 1e3, 1)}
        print("RESULT " + json.dumps(res), flush=True)
        return res
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
        srv.terminate()
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"  kept {tmp}")


# the side-by-side table: figure, its key in a run's result, how it is shown
COLUMNS = [("upload MB/s (trigger -> last file)", "upload_mb_s", "{:.1f}"),
           ("upload s (trigger -> last file)", "upload_s", "{:.2f}"),
           ("upload MB/s (first command -> last file)", "upload_window_mb_s", "{:.1f}"),
           ("server CPU s (uploads)", "upload_server_cpu_s", "{:.1f}"),
           ("load generator CPU s", "upload_clients_cpu_s", "{:.1f}"),
           ("other processes CPU s", "upload_other_cpu_s", "{:.1f}"),
           ("heartbeat p95 ms", "heartbeat_p95_ms", "{:.0f}"),
           ("server peak RSS MB", "server_peak_rss_mb", "{:.0f}"),
           ("hang trigger -> analysed s", "hang_s", "{:.2f}"),
           ("hang fan-out s", "hang_fanout_s", "{:.2f}"),
           ("stacks POST p95 ms", "stacks_p95_ms", "{:.0f}"),
           ("server CPU s (hang)", "hang_server_cpu_s", "{:.2f}"),
           ("hang assembled after last, ms", "hang_assembled_s", "{:.0f}"),
           ("snapshot: all stacks posted -> analysed s", "asm_assembled_s", "{:.2f}"),
           ("server CPU s (stacks -> analysed)", "asm_server_cpu_s", "{:.2f}")]


def table(runs: dict[str, list[dict]], order: list[str]) -> str:
    """Median (min-max) of each figure per revision; the last column: this tree / the first baseline."""
    def med(xs: list[float]) -> float:
        s = sorted(xs)
        return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
    head = ["figure"] + [f"{lab} (n={len(runs[lab])})" for lab in order]
    if len(order) > 1:
        head.append(f"{order[-1]} / {order[0]}")
    rows = [head, ["---"] * len(head)]
    for title, key, fmt in COLUMNS:
        scale = 1e3 if key == "hang_assembled_s" else 1.0
        cells, meds = [title], []
        for lab in order:
            xs = [r[key] * scale for r in runs[lab] if r.get(key) is not None]
            if not xs:
                cells.append("-")
                meds.append(None)
                continue
            m = med(xs)
            meds.append(m)
            cells.append(fmt.format(m) + (f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if len(xs) > 1 else ""))
        if len(order) > 1:
            cells.append(f"{meds[-1] / meds[0]:.2f}x" if meds[0] and meds[-1] is not None else "-")
        rows.append(cells)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=32, help="light processes holding the agents (default 32)")
    ap.add_argument("--mb", type=float, default=0.25, help="size of each agent's trace file (MiB)")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for each run")
    ap.add_argument("--baseline", action="append", default=[], metavar="REV",
                    help="also run the server and client of git revision REV (e.g. main), alternating with this "
                         "tree's, and print them side by side (may be given more than once)")
    ap.add_argument("--runs", type=int, default=1, help="runs of each revision (alternating; default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders")
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(a.child)
    if a.agents < 4 or a.procs < 1 or a.mb < 0 or a.runs < 1 or a.deadline <= 0:
        ap.error("--agents must be at least 4, --procs and --runs at least 1, --mb at least 0, --deadline positive")
    trees = tempfile.mkdtemp(prefix="aiprof-load-revs-")
    try:
        configs: list[tuple[str, str | None]] = []
        for rev in a.baseline:
            src, sha = checkout(rev, trees)
            configs.append((rev if rev == sha else f"{rev} ({sha})", src))
        configs.append(("this tree", None))
        runs: dict[str, list[dict]] = {lab: [] for lab, _ in configs}
        for i in range(a.runs):
            for lab, src in configs:
                runs[lab].append(run_once(a, src, f"{lab}, run {i + 1}/{a.runs}"))
        if len(configs) > 1 or a.runs > 1:
            print(f"\n{a.agents} agents, {2 * a.agents} uploads of {a.mb:g} MiB + 256 B; median (min-max) of "
                  f"{a.runs} run(s) each, alternating:")
            print(table(runs, [lab for lab, _ in configs]))
        return 0 if all(r["ok"] for rs in runs.values() for r in rs) else 1
    finally:
        shutil.rmtree(trees, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
