"""Where the per-rank tasks run: this process, an embedded local Ray, or a Ray cluster.

An engine maps a task function over a list of argument tuples and yields each result as it
completes, with its index. Ray is started by aiprof itself when no cluster is named (nothing to
install or start by hand) and stopped when the analysis ends; a Ray already initialised by the
caller is used as it is and left running.

Ray's workers import the task functions from :mod:`aiprof.scale.tasks` by name: they never run
the caller's ``__main__`` (a script without an ``if __name__ == "__main__":`` guard is safe).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from aiprof import __version__
from aiprof.diagnosis.job import JOINT_MAX_RANKS
from aiprof.errors import AiprofError, UsageError
from aiprof.trace.workers import usable_cpus

# Ranks from which `aiprof analyze` uses Ray by default: up to JOINT_MAX_RANKS the joint replay
# prices causes across ranks, and it needs every rank in one process.
RAY_MIN_RANKS = JOINT_MAX_RANKS + 1
# The embedded Ray's object store: the summaries are a few hundred kB per rank and the driver
# fetches them as they complete, so a small store suffices (Ray's default takes 30 % of RAM).
OBJECT_STORE_BYTES = 512 << 20
# A cluster address must accept a connection within this long: Ray itself retries an address that
# does not answer for minutes.
CONNECT_TIMEOUT_S = 5.0
# Each task is one rank: one CPU. Its ingest runs in the task's own process (no worker pool
# per task: the engine already runs one task per CPU).
TASK_CPUS = 1
# auto: Ray from RAY_MIN_RANKS ranks; local: this process (the joint replay up to JOINT_MAX_RANKS
# ranks, then the per-rank path on a SerialEngine: job_report.capture_report); ray: Ray always.
ENGINES = ("auto", "local", "ray")
# Ray's token authentication (Ray >= 2.59): the variables a Ray client reads, and where its token
# loader (C++ AuthenticationTokenLoader) looks, in this order: $RAY_AUTH_TOKEN, the file
# $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token. `ray start --head` turns token auth on when a token
# exists (the embedded Ray's `ray.init()` writes ~/.ray/auth_token), but a client given an
# explicit address only sends it with RAY_AUTH_MODE=token (ray/_private/worker.py). A Ray Client
# (ray://) is no different: its gRPC channel gets the token interceptor (an "authorization:
# Bearer <token>" metadata on every call) only when that mode is on (ray/_private/grpc_utils.py
# init_grpc_channel), and the head's client server checks it on every call
# (grpc_authentication_server_interceptor).
AUTH_MODE_VAR = "RAY_AUTH_MODE"
AUTH_TOKEN_VAR = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = os.path.join("~", ".ray", "auth_token")
# A head's Ray Client server (`ray start --ray-client-server-port`, 10001 by default), as Ray names it.
RAY_CLIENT_SCHEME = "ray://"
# While the embedded Ray starts (about 6 s on the lent 16-64 vCPU machines, most of it Ray's
# daemons importing Ray one after another and a one-second poll: docs/scale.md), the first
# phase's tasks run in processes forked from this one, and Ray takes what is left once it is up.
# The start runs Ray's daemons one after another (each importing Ray) while this process waits
# on them: the pool is the Ray CPUs less one, left to them. Leaving two made no difference on 16
# vCPUs (1,024 ddp2 ranks: 32.3 / 32.7 s against 32.2 / 32.0; docs/scale.md).
RAY_START_CPUS = 1
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
# How long close() waits for the killed autoscaler monitor to be reaped (see _kill_monitor): a
# SIGKILLed process is gone in milliseconds; past this, Ray's own shutdown waits for it as before.
MONITOR_REAP_S = 1.0

Progress = Callable[[str, int, int], None]  # (phase, done, total)
# The phase Ray's start is reported as (progress file, bar).
STARTING = "starting ray"


@dataclass
class EngineStats:
    """What the tasks cost: CPU seconds summed over tasks, per phase, and the task count; on Ray,
    also where they ran: per phase, the tasks each node returned (its Ray node id)."""

    worker_cpu_s: float = 0.0
    tasks: int = 0
    by_phase: dict = field(default_factory=dict)  # phase -> {"tasks", "cpu_s", "wall_s"[, "nodes"]}

    def _phase(self, phase: str) -> dict:
        return self.by_phase.setdefault(phase, {"tasks": 0, "cpu_s": 0.0, "wall_s": 0.0})

    def reused(self, phase: str, n: int) -> None:
        """``n`` of the phase's results were read from an earlier run (scale.results): no task ran."""
        self._phase(phase)["reused"] = n

    def add(self, phase: str, cpu_s: float, node: str = "", task_wall_s: float = 0.0,
            before_ray: bool = False) -> None:
        """One task's cost; ``before_ray``: it ran in a process of this host while Ray started."""
        p = self._phase(phase)
        p["tasks"] += 1
        if before_ray:
            p["before_ray"] = p.get("before_ray", 0) + 1
        p["cpu_s"] += cpu_s
        # a task's own wall time: above its CPU time it waited (I/O, or more runnable threads
        # than cores); the phase's wall times its workers less this sum is their idle time
        p["task_wall_s"] = p.get("task_wall_s", 0.0) + task_wall_s
        if node:  # a task retried elsewhere (its node lost) counts where it finally ran
            nodes = p.setdefault("nodes", {})
            nodes[node] = nodes.get(node, 0) + 1
        self.tasks += 1
        self.worker_cpu_s += cpu_s


@dataclass
class _Failed:
    """An aiprof error a task raised, sent back as a value (its message is what the user sees;
    an exception's own pickling may not survive the trip)."""

    message: str
    exit_code: int


def _timed(fn: Callable, args: tuple) -> tuple[object, float, str, float]:
    """Run one task; return its result, the CPU seconds it took, the node it ran on and its
    wall seconds."""
    os.environ["AIPROF_INGEST_WORKERS"] = "1"  # in a Ray worker or a pool process: one task per CPU already
    w0 = time.perf_counter()
    t0 = time.process_time()
    try:
        out = fn(*args)
    except AiprofError as exc:
        out = _Failed(str(exc), exc.exit_code)
    node = ""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    return out, time.process_time() - t0, node, time.perf_counter() - w0


class SerialEngine:
    """Runs every task in this process, one after the other: the reference the Ray engine is
    tested against, and a way to run the per-rank analysis without Ray."""

    name = "serial"

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.nodes: dict[int, str] = {}

    def map(self, phase: str, fn: Callable, calls: Sequence[tuple], progress: Progress | None = None,
            nodes: Sequence[str] | None = None) -> Iterator[tuple[int, object]]:
        t0 = time.perf_counter()
        for i, args in enumerate(calls):
            c0, w0 = time.process_time(), time.perf_counter()
            out = fn(*args)
            self.stats.add(phase, time.process_time() - c0, task_wall_s=time.perf_counter() - w0)
            if progress:
                progress(phase, i + 1, len(calls))
            yield i, out
        self.stats._phase(phase)["wall_s"] += time.perf_counter() - t0

    def close(self) -> None:
        pass

    def __enter__(self) -> SerialEngine:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ray_available() -> bool:
    """Whether Ray is installed here (the ``scale`` extra), without importing it: the Ray engine
    imports it only once a phase has tasks to run (:meth:`RayEngine._load`)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except ImportError:  # an import hook that refuses it
        return False


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise AiprofError(f"the Ray engine needs Ray ({exc}): pip install 'aiprof[scale]'; "
                          "or analyse in this process with --engine local") from None
    return ray


def find_auth_token() -> str | None:
    """Where a Ray client finds its token, as the user would name it ("$RAY_AUTH_TOKEN", a file
    path), or None. A $RAY_AUTH_TOKEN_PATH that cannot be read is an error, as it is to Ray."""
    if os.environ.get(AUTH_TOKEN_VAR, "").strip():
        return f"${AUTH_TOKEN_VAR}"
    path = os.environ.get(AUTH_TOKEN_PATH_VAR)
    if path:
        try:
            with open(os.path.expanduser(path)) as f:
                if f.read().strip():
                    return path
        except OSError as exc:
            raise AiprofError(f"${AUTH_TOKEN_PATH_VAR}={path}: {exc.strerror or exc}") from None
        raise AiprofError(f"${AUTH_TOKEN_PATH_VAR}={path}: the file is empty")
    default = os.path.expanduser(DEFAULT_TOKEN_FILE)
    try:
        with open(default) as f:
            return DEFAULT_TOKEN_FILE if f.read().strip() else None
    except OSError:
        return None


def _gcs_address(address: str) -> bool:
    """A cluster's GCS named as HOST:PORT (not ray://, "auto" or "local", which Ray resolves)."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and "://" not in address)


def _client_address(address: str) -> bool:
    """A head's Ray Client server named as ray://HOST:PORT."""
    return address.startswith(RAY_CLIENT_SCHEME) and _gcs_address(address[len(RAY_CLIENT_SCHEME):])


def use_token_auth(address: str) -> str | None:
    """Before connecting to the cluster at ``address``: turn Ray's token authentication on in
    this process where the user left $RAY_AUTH_MODE unset and a token is found; return where the
    token comes from, or None when none is sent.

    This is Ray's own rule for `ray start --head` (token auth on when a token exists), so a head
    started on this machine or with the same home is reached; a client with a token also reaches
    a head without authentication (it ignores the token), so nothing is lost where it has none."""
    mode = os.environ.get(AUTH_MODE_VAR, "").lower()
    if mode and mode != "token":
        return None  # the user said so (e.g. "disabled")
    source = find_auth_token()
    if mode == "token":
        if source is None:
            raise AiprofError(f"{AUTH_MODE_VAR}=token but no Ray token was found: set ${AUTH_TOKEN_VAR} or "
                              f"${AUTH_TOKEN_PATH_VAR} to the cluster's token (the head's {DEFAULT_TOKEN_FILE})")
        return source
    if source is None or not (_gcs_address(address) or _client_address(address)):
        return None
    # what `ray.init()` does for a local Ray (authentication_token_setup._enable_token_auth): the
    # mode is read from the environment, and Ray caches its config at import: refresh it
    os.environ[AUTH_MODE_VAR] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # a Ray without token auth: nothing to refresh
        pass
    return source


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """These environment variables set meanwhile (for the processes started), then as they were."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """This process's stderr (fd 2, where Ray's C++ client logs) into ``path`` meanwhile: a
    head that refuses the client gets a warning a second for ~20 s before ray.init() gives up,
    and the one line aiprof prints says why."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _refused(address: str, token: str | None) -> str:
    """Why a cluster that accepts connections refused this client, as one line."""
    port = ("the head's Ray Client port (ray start --ray-client-server-port, 10001 by default)"
            if _client_address(address) else "the head's GCS port")
    if token:
        return (f"the Ray cluster at {address} refused this client with the token from {token}: "
                f"set ${AUTH_TOKEN_VAR} or ${AUTH_TOKEN_PATH_VAR} to the cluster's token (the head's "
                f"{DEFAULT_TOKEN_FILE}), or check that {address} is {port}")
    return (f"the Ray cluster at {address} refused this client: it may use token authentication "
            f"(Ray >= 2.59 when a token exists): set ${AUTH_TOKEN_VAR} or ${AUTH_TOKEN_PATH_VAR} to its token "
            f"(the head's {DEFAULT_TOKEN_FILE}), or check that {address} is {port}")


# A Ray Client's connection attempts log why each ping failed (ray.util.client.worker, at debug
# level): Ray 2.60's server answers a refused token with "Invalid or missing authentication token"
# (gRPC UNAUTHENTICATED); anything else (no answer in time) is not a refusal, and saying "refused"
# then would send the user after the wrong setting.
CLIENT_LOGGER = "ray.util.client.worker"
AUTH_REFUSALS = ("UNAUTHENTICATED", "AUTHENTICATION TOKEN")  # upper-cased, as kept
CLIENT_TIMEOUT_VAR = "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S"  # Ray's: its first wait, doubled per retry


@contextlib.contextmanager
def _client_errors() -> Iterator[list[str]]:
    """The Ray Client's connection log lines (upper-cased) while the block runs."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            with contextlib.suppress(Exception):
                seen.append(record.getMessage().upper())

    log, handler = logging.getLogger(CLIENT_LOGGER), Keep(logging.DEBUG)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _client_timeout(address: str) -> str:
    return (f"the Ray Client server at {address} did not answer in time (Ray gave up after its retries): check "
            f"that it is the head's Ray Client port (ray start --ray-client-server-port, 10001 by default) and "
            f"that the head is not overloaded; ${CLIENT_TIMEOUT_VAR} makes Ray wait longer")


def _aiprof_path() -> str:
    """The folder aiprof is imported from, so that Ray's workers import the same aiprof."""
    import aiprof

    return os.path.dirname(os.path.dirname(os.path.abspath(aiprof.__file__)))


class RayEngine:
    """Runs the tasks on Ray: a cluster when ``address`` (or $RAY_ADDRESS) names one, else a
    local Ray that this engine starts and stops. ``cpus`` caps the local Ray's CPUs.

    A named cluster is connected to at once (a wrong address or token is the first thing the user
    hears of); the local Ray is started by the first phase that has tasks to run (about 6 s on 64
    cores, 2.5-4.5 s on 2; that phase's first tasks run beside it: :meth:`_start_alongside`),
    so an analysis whose results are all kept (scale.results) starts none,
    nor imports Ray (0.25-0.35 s on 2 cores, 0.7-1.2 s on the lent machines).
    ``on_start(phase, done, total)`` hears of the start ("starting ray": 0 then 1 of 1)."""

    name = "ray"

    def __init__(self, address: str | None = None, cpus: int | None = None,
                 on_start: Progress | None = None) -> None:
        self.ray = None  # the module, once imported (_load)
        self.stats = EngineStats()
        self.owned = False
        self.start_s = 0.0  # wall seconds this engine spent starting or connecting to Ray
        self.import_s = 0.0  # and importing it
        self.nodes: dict[int, str] = {}
        self._remote = None
        self._address = address or os.environ.get("RAY_ADDRESS") or None
        self._cpus = cpus
        self._on_start = on_start
        caller = sys.modules.get("ray")  # a Ray this process has initialised is used as it is
        self._started = caller is not None and caller.is_initialized()
        if self._started:
            self._load()
        elif self._address:
            self._start()

    def _load(self) -> None:
        """Import Ray and declare the task (once)."""
        if self._remote is not None:
            return
        t0 = time.perf_counter()
        ray = self.ray = _import_ray()
        self._remote = ray.remote(num_cpus=TASK_CPUS)(_timed)
        self.import_s += time.perf_counter() - t0

    def _start(self) -> None:
        """Import Ray and start the local one, or connect to the cluster (once)."""
        if self._started:
            return
        self._started = True
        if self._on_start:
            self._on_start(STARTING, 0, 1)
        self._load()
        t0 = time.perf_counter()
        self._init(self._address, self._cpus)
        self.start_s = time.perf_counter() - t0
        if self._on_start:
            self._on_start(STARTING, 1, 1)

    def _init(self, address: str | None, cpus: int | None) -> None:
        ray = self.ray
        # workers import aiprof from where this process does (an editable install, PYTHONPATH=src)
        path = os.pathsep.join(p for p in (_aiprof_path(), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "AIPROF_INGEST_WORKERS": "1"}
        quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
        token = None
        if address:
            _reachable(address)
            token = use_token_auth(address)
        try:
            if address:
                # a cluster: its nodes have aiprof installed (docs/scale.md); our path is ours only
                with _stderr_to(os.devnull), _client_errors() as seen:
                    ray.init(address=address, **quiet)
            else:
                # the workers' environment is the raylet's, inherited from this process: set here
                # rather than as a runtime_env, whose workers Ray starts only once the first task
                # asks for them (the workers it started with init have the default env): 1.5-2 s
                # later on 2 cores (bench/ray_start.py)
                with _environ(env):
                    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                             object_store_memory=OBJECT_STORE_BYTES, **quiet)
        except ConnectionError as exc:
            # it accepted a TCP connection (_reachable); a Ray Client whose every ping is refused
            # (UNAUTHENTICATED, or not a client server) gives up with "ray client connection timeout"
            if address and _client_address(address) and not any(r in m for m in seen for r in AUTH_REFUSALS):
                raise AiprofError(_client_timeout(address)) from None
            if address and (_gcs_address(address) or _client_address(address)):
                raise AiprofError(_refused(address, token)) from None
            raise AiprofError(_cannot_start(address, exc)) from None
        except (RuntimeError, ValueError, ImportError, ray.exceptions.RayError) as exc:  # ray:// needs ray[client]
            raise AiprofError(_cannot_start(address, exc)) from None
        self.owned = True
        if address:
            self._check_version()

    def _check_version(self) -> None:
        """A cluster's workers must run this aiprof: another version would summarise differently."""
        import aiprof

        ver = self.ray.get(self.ray.remote(num_cpus=0)(lambda: __import__("aiprof").__version__).remote())
        if ver != aiprof.__version__:
            raise AiprofError(f"the Ray cluster's workers run aiprof {ver}, this is {__version__}: install the same version")

    @property
    def cpus(self) -> int:
        self._start()
        return int(self.ray.cluster_resources().get("CPU", 1))

    def _start_alongside(self, fn: Callable, calls: Sequence[tuple]) -> dict:
        """Start the local Ray while a pool of processes forked from this one runs the calls
        (RAY_START_CPUS); return the pool's futures of the calls it took (future -> index), the
        pool shut down: those not begun by the time Ray is up are cancelled, for Ray to run."""
        workers = (self._cpus or usable_cpus()) - RAY_START_CPUS
        if workers < 1 or len(calls) < 2 or not _can_fork():  # (a cluster is connected at init)
            self._start()
            return {}
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # forked before Ray is imported or started: the children hold none of its threads. Not
        # trace.workers' pool: its fresh interpreters take seconds to import numpy and aiprof on
        # a loaded machine, much of the start this pool is there to use
        pool = ProcessPoolExecutor(min(workers, len(calls)), mp_context=multiprocessing.get_context("fork"),
                                   initializer=_pool_process, initargs=(os.getpid(), _prctl()))
        try:
            futures = {pool.submit(_timed, fn, args): i for i, args in enumerate(calls)}
            self._start()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # what runs finishes: a task at most
            raise
        # cancelled here, not by shutdown(cancel_futures=True): its pool thread cancels later, and
        # a future cancelled there would never be seen to end. cancel() fails for those begun.
        begun = {f: i for f, i in futures.items() if not f.cancel()}
        pool.shutdown(wait=False)
        return begun

    def map(self, phase: str, fn: Callable, calls: Sequence[tuple], progress: Progress | None = None,
            nodes: Sequence[str] | None = None) -> Iterator[tuple[int, object]]:
        """Submit every call; yield (index, result) as each completes. ``nodes``: the node each
        call should prefer (where its rank's store was written), if the cluster has several.
        The phase that starts the local Ray runs its first calls beside the start
        (:meth:`_start_alongside`)."""
        if not calls:
            return
        early = {} if self._started else self._start_alongside(fn, calls)
        # the phase's wall from here, Ray up: its start (start_s) is where the early tasks ran
        t0 = time.perf_counter()
        ray = self.ray
        here = ray.get_runtime_context().get_node_id() if early else ""  # the local Ray's one node
        many_nodes = nodes is not None and len({n for n in nodes if n}) > 1
        refs = {}

        def submit(i: int) -> object:
            opts = {}
            if many_nodes and nodes[i]:
                from ray.util.scheduling_strategies import (
                    NodeAffinitySchedulingStrategy,
                )

                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[i], soft=True)
            ref = self._remote.options(**opts).remote(fn, calls[i])
            refs[ref] = i
            return ref

        taken = set(early.values())
        pending = [submit(i) for i in range(len(calls)) if i not in taken]
        self.nodes: dict[int, str] = {}
        done_n = 0

        def deliver(i: int, out: object, cpu: float, node: str, wall: float, before_ray: bool = False) -> object:
            nonlocal done_n
            if isinstance(out, _Failed):
                err = AiprofError(out.message)
                err.exit_code = out.exit_code
                raise err
            self.stats.add(phase, cpu, node, wall, before_ray)
            self.nodes[i] = node
            done_n += 1
            if progress:
                progress(phase, done_n, len(calls))
            return out

        try:
            if early:
                from concurrent.futures import as_completed
                from concurrent.futures.process import BrokenProcessPool

                for f in as_completed(early):  # begun before Ray's: the first to end
                    i = early[f]
                    try:
                        out, cpu, _, wall = f.result()
                    except BrokenProcessPool:  # a process of the pool died (killed): Ray runs it
                        pending.append(submit(i))
                        continue
                    yield i, deliver(i, out, cpu, here, wall, before_ray=True)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                if pending:  # and every other result already in: a wait costs O(pending), so one
                    # result per wait made a phase O(N²) (bench/ray_wait.py: 1,024 results)
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    ready += more
                try:
                    outs = ray.get(ready)
                except ray.exceptions.RayTaskError as exc:
                    raise _unwrap(exc) from None
                for ref, (out, cpu, node, wall) in zip(ready, outs):
                    i = refs.pop(ref)
                    yield i, deliver(i, out, cpu, node, wall)
        finally:
            for ref in pending:  # leaving early (an error, Ctrl-C): stop what is still queued
                ray.cancel(ref, force=True)
            self.stats._phase(phase)["wall_s"] += time.perf_counter() - t0

    def close(self) -> None:
        if self.owned:
            if not self._address:  # the local Ray this engine started
                _kill_monitor()
            self.ray.shutdown()
            self.owned = False

    def __enter__(self) -> RayEngine:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _can_fork() -> bool:
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


def _prctl() -> Callable | None:
    """libc's prctl, looked up here: a forked child must not dlopen (a lock another thread of the
    parent may have held at the fork); None where there is none (not Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None


def _pool_process(parent: int, prctl: Callable | None) -> None:
    """A pool process (forked: its arguments are not pickled) leaves Ctrl-C to the driver, which
    shuts the pool down (no traceback per process), and dies with it: a driver killed (SIGKILL,
    the OOM killer) would leave it waiting on the pool's queue for ever."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the driver died before the signal was armed
        os._exit(1)


def _kill_monitor() -> None:
    """Stop the local Ray's autoscaler monitor before ``ray.shutdown()`` does: it adds a second.

    Ray's shutdown stops the raylet, then the GCS, then the rest, each with SIGTERM and up to a
    second's wait before SIGKILL. The monitor's SIGTERM handler reports its end to the GCS: with
    the GCS gone it is still running after 5 s, so the shutdown waits out its second (1.0 of the
    1.33 s ray.shutdown() took on 2 cores, ray 2.60); with the GCS up it takes 0.6 s and sends
    the driver a traceback. A local Ray has nothing to autoscale and every task is done, so the
    monitor is killed outright. Its handle is in Ray's private node object: where a Ray lays it
    out otherwise, nothing is done here and the shutdown is as slow as before, never wrong."""
    try:
        from ray._private import ray_constants
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        infos = list(node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])) if node is not None else []
        for info in infos:
            info.process.kill()
        for info in infos:
            info.process.wait(timeout=MONITOR_REAP_S)
    except Exception:  # noqa: BLE001 - a speed-up only: any surprise leaves Ray's shutdown to do it
        pass


def _cannot_start(address: str | None, exc: Exception) -> str:
    where = f"the Ray cluster at {address}" if address else "a local Ray"
    return f"cannot start {where}: {str(exc).splitlines()[0] if str(exc) else exc!r}"


def _reachable(address: str) -> None:
    """A one-line error at once when a cluster address (``ray://HOST:PORT`` or ``HOST:PORT``) does
    not accept a connection; other forms ("auto", "local") are left to Ray."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise AiprofError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None


def _unwrap(exc: Exception) -> Exception:
    """The error a task raised, as the CLI shows it: aiprof's own errors as they are (one line),
    a worker that cannot import aiprof as what to install."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, AiprofError):
        return cause
    if isinstance(cause, ModuleNotFoundError) and (cause.name or "").startswith("aiprof"):
        return AiprofError(f"the Ray workers cannot import aiprof ({cause}): install aiprof {__version__} on every node")
    return exc


def choose(engine: str, n_files: int, cluster: str | None = None) -> str:
    """"local" (this process) or "ray": ``engine`` as given; for "auto", Ray when ``cluster`` is
    named (--cluster) or from RAY_MIN_RANKS ranks ($RAY_ADDRESS only says which Ray to use)."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if cluster and engine == "local":
        raise UsageError("--cluster names a Ray cluster: it does not go with --engine local")
    if engine != "auto":
        return engine
    return "ray" if cluster or n_files >= RAY_MIN_RANKS else "local"


def without_ray(n_files: int, cluster: str | None = None) -> str:
    """The engine when Ray was chosen but cannot be imported (aiprof without the ``scale``
    extra): "serial", the same per-rank pipeline in this process (the report Ray would give,
    rank after rank), with one hint line on stderr; a named cluster is an error."""
    if cluster:
        raise AiprofError(f"--cluster {cluster}: Ray is not installed: pip install 'aiprof[scale]'")
    print(f"aiprof: Ray is not installed: analysing {n_files} ranks in-process "
          f"(pip install 'aiprof[scale]' for the parallel engine)", file=sys.stderr)
    return "serial"


def make(engine: str, address: str | None = None, cpus: int | None = None,
         on_start: Progress | None = None) -> SerialEngine | RayEngine:
    """An engine for the per-rank analysis by name: "ray" or "serial"."""
    return RayEngine(address, cpus, on_start) if engine == "ray" else SerialEngine()
