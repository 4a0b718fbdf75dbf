"""`aiprof analyze --cluster` on a real two-node Ray cluster: a head (`ray start --head`) and a
second node (`ray start --address HEAD`), separate processes on this machine, each with one CPU,
its own custom resource (which names it: the probe below maps it to its Ray node id) and its own
--temp-dir. Ray's token authentication is on (Ray's default where a token exists).

Where the tasks ran is read from `--stats` (`phases.<phase>.nodes`: tasks per Ray node id); the
reference report is the same per-rank pipeline in the test's process (a SerialEngine).

Losing the second node mid-run: another job holds the head's CPU, so every task goes to the
second node; once one of its Ray workers runs an aiprof task (its process title is
``ray::_timed``), its whole process group (raylet, object store, workers) is killed, then the
other job, which frees the head for the retried tasks.
The run must still end within ANALYZE_TIMEOUT_S with the complete report: Ray retries the lost
tasks on the head.

Processes are stopped by killing their process groups, never by `ray stop` (it would stop every
Ray on the machine, other tests' and other users' included).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiprof.scale import engines
from aiprof.scale.job_report import build_job_report
from aiprof.trace.store import find_trace_files
from tests.deps import need
from tests.scale.rayhead import (
    HEAD_START_TIMEOUT_S,
    KILL_WAIT_S,
    Head,
    child_env,
    ray_home,
    start_head,
)

need("ray")

HEAD_RESOURCE = "aiprof_test_head"  # custom resources: which node is which, in Ray's node table
NODE_RESOURCE = "aiprof_test_node2"
# The second node's object store: a few ranks' summaries (Ray's minimum is 75 MiB).
NODE_OBJECT_STORE_BYTES = 128 << 20
# `aiprof analyze` of 4 ranks on two 1-CPU nodes: ~20 s here; after losing a node, Ray notices
# the lost worker at once, and marks the node dead after its health checks (~30 s by default).
ANALYZE_TIMEOUT_S = 300.0
# How often the test looks for a task running on the second node (a task runs ~0.3-1 s here).
POLL_S = 0.02
# The probe connects to the head and waits for both nodes in Ray's node table.
PROBE = textwrap.dedent("""
    import json, sys, time
    import ray
    from aiprof.scale import engines
    engines.use_token_auth(sys.argv[1])
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + float(sys.argv[2])
    while True:
        ids = {r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in n["Resources"] if r.startswith("aiprof_test_")}
        if len(ids) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(json.dumps(ids))
""")


# Another job holding the head's one CPU (a task pinned there by the head's resource) until it is
# killed; it says "holding" once Ray shows the head's resource taken.
BLOCKER = textwrap.dedent("""
    import sys, time
    import ray
    from aiprof.scale import engines
    engines.use_token_auth(sys.argv[1])
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    ref = ray.remote(lambda: time.sleep(3600)).options(num_cpus=1, resources={sys.argv[2]: 1}).remote()
    while ray.available_resources().get(sys.argv[2], 0) > 0:
        time.sleep(0.1)
    print("holding", flush=True)
    ray.get(ref)
""")


class Node:
    """`ray start --address HEAD --block`: a second node in its own process group and temp dir."""

    def __init__(self, root: Path, env: dict[str, str], head: str) -> None:
        root.mkdir(parents=True)
        self.temp = Path(tempfile.mkdtemp(prefix="aiprof-ray-"))  # short: AF_UNIX path limit
        self.log = root / "node.log"
        ray_cli = Path(sys.executable).with_name("ray")
        cmd = [str(ray_cli) if ray_cli.exists() else "ray", "start", "--address", head, "--block",
               "--num-cpus", "1", "--resources", json.dumps({NODE_RESOURCE: 1}), "--disable-usage-stats",
               "--object-store-memory", str(NODE_OBJECT_STORE_BYTES), "--temp-dir", str(self.temp)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self) -> None:
        """`ray start` writes ray_current_cluster into its temp dir once the node's processes run."""
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while not (self.temp / "ray_current_cluster").exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no second node after {HEAD_START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)  # polling a condition, with a deadline

    def processes(self) -> set[int]:
        """This node's processes: `ray start`'s and their descendants (Ray's workers are in
        process groups of their own)."""
        children: dict[int, list[int]] = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(pid))
        out, todo = set(), [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.add(pid)
            todo += [c for c in children.get(pid, []) if c not in out]
        return out

    def running_task(self) -> bool:
        """Whether a process of this node runs an aiprof task (Ray titles it ray::_timed)."""
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::_timed"):
                        return True
            except OSError:  # gone meanwhile
                continue
        return False

    def kill(self) -> None:
        """The node is lost: every process of it is killed at once, as by a machine's failure."""
        procs = self.processes()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # raylet, object store, agents
        except ProcessLookupError:
            pass
        for pid in procs - {self.proc.pid}:  # its workers, in their own groups
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=KILL_WAIT_S)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


class Cluster:
    def __init__(self, head: Head, node: Node, ids: dict[str, str], env: dict[str, str]) -> None:
        self.head, self.node, self.env = head, node, env
        self.head_id, self.node_id = ids[HEAD_RESOURCE], ids[NODE_RESOURCE]


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    """A fresh two-node cluster per test (the node-loss test kills its second node)."""
    env = child_env(ray_home(tmp_path / "client", os.urandom(16).hex()))
    for head in start_head(tmp_path / "head", env, ["--resources", json.dumps({HEAD_RESOURCE: 1})]):
        # a node joining a head with token auth must be told so (Ray: RAY_AUTH_MODE=token ray start --address)
        node = Node(tmp_path / "node2", {**env, engines.AUTH_MODE_VAR: "token"}, head.address)
        try:
            node.wait_up()
            p = subprocess.run([sys.executable, "-c", PROBE, head.address, str(HEAD_START_TIMEOUT_S)], env=env,
                               capture_output=True, text=True, timeout=2 * HEAD_START_TIMEOUT_S, check=False)
            assert p.returncode == 0, p.stderr[-3000:]
            ids = json.loads(p.stdout.strip().splitlines()[-1])
            assert sorted(ids) == [HEAD_RESOURCE, NODE_RESOURCE], (ids, node.log.read_text()[-3000:])
            yield Cluster(head, node, ids, env)
        finally:
            node.stop()


@pytest.fixture(scope="module")
def reference(ddp4_dir) -> dict:
    """The report of the same per-rank pipeline, in this process."""
    with engines.SerialEngine() as serial:
        return json.loads(json.dumps(build_job_report(find_trace_files([str(ddp4_dir)]), serial)))


def _analyze(c: Cluster, ddp4_dir: Path, out: Path) -> subprocess.Popen:
    """`aiprof analyze --cluster`: the report in out/report.json, stderr in out/stderr, --stats in out/stats.json
    (files, not pipes: the test polls meanwhile, and a full pipe would stop the child)."""
    out.mkdir()
    with open(out / "report.json", "wb") as so, open(out / "stderr", "wb") as se:
        return subprocess.Popen([sys.executable, "-m", "aiprof", "analyze", str(ddp4_dir), "--cluster", c.head.address,
                                 "--json", "--no-cache", "--stats", str(out / "stats.json")], env=c.env, stdout=so,
                                stderr=se)


def _finish(p: subprocess.Popen, out: Path) -> tuple[dict, dict]:
    """The report and the stats, once the run ends (exit 0) within ANALYZE_TIMEOUT_S."""
    try:
        p.wait(timeout=ANALYZE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"aiprof analyze hung: over {ANALYZE_TIMEOUT_S} s; stderr: "
                             f"{(out / 'stderr').read_text()[-3000:]}") from None
    assert p.returncode == 0, (out / "stderr").read_text()[-3000:]
    return json.loads((out / "report.json").read_text()), json.loads((out / "stats.json").read_text())


def test_tasks_run_on_both_nodes(cluster, ddp4_dir, reference, tmp_path):
    """ddp4 (4 ranks, rank 2 the straggler) on a head and a second node of one CPU each: both
    nodes run tasks, and the report is the in-process pipeline's."""
    out = tmp_path / "run"
    report, stats = _finish(_analyze(cluster, ddp4_dir, out), out)
    assert report == reference
    phases = stats["phases"]
    print({ph: v.get("nodes") for ph, v in phases.items()})  # shown with -s: where each phase ran
    ran = {n for v in phases.values() for n in v["nodes"]}
    assert ran == {cluster.head_id, cluster.node_id}
    assert {ph: v["tasks"] for ph, v in phases.items()} == {"ingest": 4, "analyse": 4, "stragglers": 1}
    assert all(sum(v["nodes"].values()) == v["tasks"] for v in phases.values())


def test_losing_the_second_node_mid_run(cluster, ddp4_dir, reference, tmp_path):
    """The second node is killed while it runs a task: Ray retries the lost work on the head, and
    the run ends with the complete report, within ANALYZE_TIMEOUT_S. The head's CPU is held by
    another job's task (BLOCKER) until then, so that every task goes to the second node: left to
    Ray, some runs gave it none, or tasks too short to be seen running (a flaky test)."""
    out = tmp_path / "run"
    blocker = subprocess.Popen([sys.executable, "-c", BLOCKER, cluster.head.address, HEAD_RESOURCE], env=cluster.env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    p = None
    try:
        assert blocker.stdout.readline().strip() == "holding", "the head's CPU was never taken"
        p = _analyze(cluster, ddp4_dir, out)
        deadline = time.monotonic() + ANALYZE_TIMEOUT_S
        while not cluster.node.running_task():
            assert p.poll() is None, f"the run ended before the second node ran a task: {(out / 'stderr').read_text()}"
            assert time.monotonic() < deadline, "the second node never ran a task"
            time.sleep(POLL_S)  # polling a condition, with a deadline
        killed = time.monotonic()
        cluster.node.kill()
        blocker.kill()  # its job ends: Ray frees the head's CPU for the retried tasks
        blocker.wait()
        report, stats = _finish(p, out)
    finally:
        for proc in (p, blocker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    print(f"second node killed; the run ended {time.monotonic() - killed:.1f} s later")
    assert report == reference  # stdout is the report alone: Ray's notice of the retry went to stderr
    err = (out / "stderr").read_text()
    assert cluster.node_id in err, err[-3000:]  # Ray's notice names the lost node: its task was retried
    phases = stats["phases"]
    print({ph: v.get("nodes") for ph, v in phases.items()})
    assert {ph: v["tasks"] for ph, v in phases.items()} == {"ingest": 4, "analyse": 4, "stragglers": 1}
