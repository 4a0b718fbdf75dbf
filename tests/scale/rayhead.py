"""Real Ray clusters for the tests: a head (`ray start --head --block`) and worker nodes (`ray start
--address`), each a subprocess in its own process group, with its own --temp-dir (a short folder in
the system's temp: Ray's socket paths under it have a length limit) and a $HOME under tmp_path (the
token lives in ~/.ray/auth_token, Ray's default place). GCS port 0 (Ray picks a free one and writes
the address into <temp-dir>/ray_current_cluster, the head's readiness signal), no dashboard. A node
is stopped by killing its process group: `ray stop` would stop every Ray on the machine, the
embedded local Ray of other tests included.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from aiprof.scale import engines

# A head on two shared cores starts in 5-15 s; far above that it is broken, not slow.
HEAD_START_TIMEOUT_S = 120.0
# The whole `aiprof analyze` of two ranks on the head (connect, ingest, analyse): ~10 s here;
# a refused client gives up after Ray's own ~20 s of retries.
ANALYZE_TIMEOUT_S = 300.0
# Ray Client's first wait for the head (Ray's default is 5 s); see child_env.
CLIENT_FIRST_WAIT_S = 20
# After SIGKILL the group's processes are gone at once; waiting on `ray start` is bounded anyway.
KILL_WAIT_S = 30.0
# `ray start` once more when it exits before the head is up: the Ray Client port, free when picked,
# may be taken by another process before the head binds it (a tiny race on a shared machine).
HEAD_STARTS = 2
# How `ray start --block` names the Ray Client server when it exits ("Some Ray subprocesses exited
# unexpectedly"): the process that fails to bind a taken port.
CLIENT_SERVER_PROCESS = "ray_client_server"
# /proc/net/tcp's state of a listening socket.
TCP_LISTEN = "0A"
# gRPC's pthread_atfork handlers (grpc/doc/fork_support.md); see child_env.
GRPC_FORK_VAR = "GRPC_ENABLE_FORK_SUPPORT"
RAY_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def child_env(home: Path, **extra: str) -> dict[str, str]:
    """This test's environment for a child, without the Ray settings of this process (an
    embedded Ray started by another test sets RAY_AUTH_MODE=token in os.environ)."""
    env = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    src = str(Path(engines.__file__).resolve().parents[2])  # the aiprof under test, for the head's workers too
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p),
               AIPROF_PROGRESS="never", **extra)
    # A Ray Client's first connection waits for the head to start a server for it (a new Python
    # process importing Ray): on CI's two busy cores that outlasted Ray's default patience (5 s,
    # doubled per retry, 3 tries), so a client that would have been served timed out.
    env.setdefault(engines.CLIENT_TIMEOUT_VAR, str(CLIENT_FIRST_WAIT_S))
    # The head's Ray Client proxier forks+execs a server per client while its gRPC threads run; with
    # gRPC's fork handlers on, 2 of 24 spawns died on two busy cores ("Check failed:
    # next_worker->state == KICKED", or epoll_wait EBADF), and the client timed out: Ray issue
    # 63202 (~7 %). gRPC's own advice for a process that always execs after fork is to turn the
    # handlers off (0 of 40 after).
    env.setdefault(GRPC_FORK_VAR, "false")
    return env


def ray_home(root: Path, token: str | None) -> Path:
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    if token:
        (home / ".ray" / "auth_token").write_text(token)
    return home


def _free_port() -> int:
    """A TCP port free on every interface now (the kernel's pick for port 0). Another process may
    take it before the head binds it: start_head then starts the head once more."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _listener_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if int(cols[1].rpartition(":")[2], 16) == port and cols[3] == TCP_LISTEN:
                    inodes.add(cols[9])
    return inodes


def _group_listens(pgid: int, port: int) -> bool:
    """Whether a process of group ``pgid`` (the head's) listens on ``port``: the Ray Client server
    is up, and the port is its own, not another process's that took it first."""
    sockets = {f"socket:[{i}]" for i in _listener_inodes(port)}
    if not sockets:
        return False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            fd_dir = f"/proc/{pid}/fd"
            if any(os.readlink(os.path.join(fd_dir, fd)) in sockets for fd in os.listdir(fd_dir)):
                return True
        except OSError:  # gone meanwhile, or not ours
            continue
    return False


class HeadExited(AssertionError):
    """`ray start` ended before the head was up (e.g. its Ray Client port was taken meanwhile)."""


class Head:
    """A `ray start --head --block` in its own process group, with its Ray Client server on a
    free port (with ray[client] installed Ray would take 10001: two heads, other engineers'
    included, would clash there); ``address`` (its GCS) and ``client`` (ray://) once it is up."""

    def __init__(self, root: Path, env: dict[str, str], extra: Sequence[str] = ()) -> None:
        """``extra``: more `ray start` options (e.g. --resources, another --num-cpus)."""
        root.mkdir(parents=True)
        # Ray's --temp-dir holds its AF_UNIX sockets (at most 107 bytes): a short folder in the
        # system's temp, not pytest's deep tmp_path
        self.temp = Path(tempfile.mkdtemp(prefix="aiprof-ray-"))
        self.log = root / "head.log"
        self.client_port = _free_port()
        ray_cli = Path(sys.executable).with_name("ray")
        cmd = [str(ray_cli) if ray_cli.exists() else "ray", "start", "--head", "--block", "--port", "0",
               "--ray-client-server-port", str(self.client_port),
               "--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats",
               "--object-store-memory", str(engines.OBJECT_STORE_BYTES), "--temp-dir", str(self.temp), *extra]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.address = ""
        self.client = f"ray://127.0.0.1:{self.client_port}"

    def wait_address(self) -> str:
        """The GCS address, once `ray start` has written it and the head's Ray Client server listens."""
        addr_file = self.temp / "ray_current_cluster"  # written by `ray start` once the head is up
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HeadExited(f"ray start exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            text = addr_file.read_text().strip() if addr_file.exists() else ""
            if text.rpartition(":")[2].isdigit() and _group_listens(self.proc.pid, self.client_port):
                return text
            time.sleep(0.1)  # polling a condition, with a deadline
        raise AssertionError(f"no Ray head after {HEAD_START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the head's GCS, raylet, agents and workers
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=KILL_WAIT_S)
        # the head's logs stay beside head.log (pytest keeps its last tmp folders): a failure can be read
        with contextlib.suppress(OSError):
            shutil.copytree(self.temp / "session_latest" / "logs", self.log.with_name("logs"), symlinks=False)
        shutil.rmtree(self.temp, ignore_errors=True)


def start_head(root: Path, env: dict[str, str], extra: Sequence[str] = ()) -> Iterator[Head]:
    for attempt in range(HEAD_STARTS):
        head = Head(root / f"start{attempt}", env, extra)
        try:
            try:
                head.address = head.wait_address()
            except HeadExited as exc:
                if attempt + 1 < HEAD_STARTS and CLIENT_SERVER_PROCESS in str(exc):
                    continue  # a port taken between _free_port and the head's bind: once more
                raise
            yield head
            return
        finally:  # also when it never came up: its group may hold processes already
            head.stop()


def analyze(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`aiprof analyze` with --no-cache: the tasks run on the head each time (another test's results
    of the same traces, kept beside their stores, would otherwise be read instead)."""
    return subprocess.run([sys.executable, "-m", "aiprof", "analyze", "--no-cache", *args], env=env, capture_output=True,
                          text=True, timeout=ANALYZE_TIMEOUT_S, check=False)
