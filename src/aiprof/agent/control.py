"""Control channel: one Unix socket per agent in a per-user runtime folder, JSON lines.

Server side (agent thread ``aiprof-control``) and client side (the CLI) share this module.

Protocol, one request per connection::

    -> {"op": "status"}
    <- {"pid": .., "rank": .., "steps": .., "step_ms": .., "state": .., "job": ..}
    -> {"op": "capture", "request": {...CaptureRequest...}}
    <- {"accepted": true, "capture_id": ..}          (or {"accepted": false, "error": ..})
    <- {"done": true, "ok": true, "dir": ..., "error": null}   (when the export finished)
    -> {"op": "collectives"}
    <- {"pid": .., "rank": .., "last_collectives": {...agent.collectives.snapshot()...}}
    -> {"op": "stacks"}
    <- {"pid": .., "rank": .., "threads": [...], "last_collectives": {...}}   (no py-spy needed)

The socket folder is /tmp/aiprof-<uid> (mode 0700) or $AIPROF_RUNTIME_DIR, used (by the agent
and by clients) only when it is a real folder of that user that nobody else can write; a socket
whose process is gone is removed by the next client that finds it.
"""
from __future__ import annotations

import glob
import json
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiprof.agent import log
from aiprof.agent.privdir import UnsafePath, check_private_dir, ensure_private_dir
from aiprof.protocol import CaptureRequest, runtime_dir

MAX_LINE = 1 << 20
IDLE_POLL_S = 1.0
ARMED_POLL_S = 0.05


def socket_path(rt: str, pid: int) -> str:
    return os.path.join(rt, f"agent-{pid}.sock")


def _read_line(conn: socket.socket, timeout: float) -> dict | None:
    """Read one JSON line (bounded size, bounded time); None on EOF/timeout."""
    conn.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) > MAX_LINE:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except (socket.timeout, OSError):
            return None
        if not chunk:
            return None
        buf += chunk
    line = buf.split(b"\n", 1)[0]
    return json.loads(line)


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj, default=str).encode() + b"\n")


class ControlServer:
    """Accepts control connections on a daemon thread; also drives the capture driver's poll."""

    def __init__(self, agent: Any, rt: str | None = None) -> None:
        self.agent = agent
        self.rt = rt or runtime_dir()
        self.path = socket_path(self.rt, os.getpid())
        self.sock: socket.socket | None = None
        self.refused: str | None = None  # why there is no socket (the runtime folder is not ours alone)
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen in the runtime folder once it is checked ours alone; in one another user made
        (or can write), say so in one line and run without a socket: the job and any capture
        already requested go on, only ``aiprof trigger`` cannot reach this process."""
        try:
            ensure_private_dir(self.rt)
        except UnsafePath as exc:
            self.refused = (f"not listening for aiprof trigger: the runtime folder {exc}; "
                            "remove it or set AIPROF_RUNTIME_DIR to a folder of yours")
            log.warn_once("runtime-dir", self.refused)
        if self.refused is None:
            try:
                os.unlink(self.path)  # a previous process with our pid
            except FileNotFoundError:
                pass
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(self.path)
            os.chmod(self.path, 0o600)
            s.listen(16)
            self.sock = s
        self.thread = threading.Thread(target=self._run, name="aiprof-control", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            if self.sock is not None:
                self.sock.close()
            os.unlink(self.path)
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait_s = ARMED_POLL_S if self.agent.needs_fast_poll() else IDLE_POLL_S
                conn = None
                if self.sock is None:  # no socket (refused folder): still drive the captures' polling
                    self._stop.wait(wait_s)
                else:
                    self.sock.settimeout(wait_s)
                    try:
                        conn, _ = self.sock.accept()
                    except socket.timeout:
                        pass
                self.agent.poll()
                if conn is not None:
                    self._handle(conn)
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.5)
            except Exception as exc:
                log.error("control channel", exc)
                time.sleep(0.5)

    def _handle(self, conn: socket.socket) -> None:
        keep = False
        try:
            msg = _read_line(conn, 2.0)
            if not isinstance(msg, dict):
                return
            op = msg.get("op")
            if op == "status":
                _send(conn, self.agent.status())
            elif op in ("collectives", "stacks"):
                from aiprof.agent.capture import rank_info
                from aiprof.agent.collectives import snapshot

                reply: dict[str, Any] = {"pid": os.getpid(), **rank_info()}
                if op == "stacks":  # taken first: the flight recorder dump may take a moment
                    from aiprof.agent.autotrigger import thread_stacks

                    reply["threads"] = thread_stacks()
                reply["last_collectives"] = snapshot()
                _send(conn, reply)
            elif op == "capture":
                try:
                    req = CaptureRequest.from_dict(msg.get("request") or {})
                except Exception as exc:
                    _send(conn, {"accepted": False, "error": f"bad request: {exc}"})
                    return
                if req.entry:
                    self.agent.set_entry(req.entry)

                def done(result: dict, conn: socket.socket = conn) -> None:
                    try:
                        conn.settimeout(2.0)
                        _send(conn, {"done": True, **result})
                    except OSError:
                        pass
                    finally:
                        conn.close()

                err = self.agent.driver.submit(req, done)
                if err:
                    _send(conn, {"accepted": False, "error": err})
                else:
                    _send(conn, {"accepted": True, "capture_id": req.capture_id, "pid": os.getpid()})
                    keep = True
            else:
                _send(conn, {"error": f"unknown op {op!r}"})
        except Exception as exc:
            log.error("control request", exc)
        finally:
            if not keep:
                conn.close()


# -- client side (CLI) --------------------------------------------------------------------------


@dataclass
class Endpoint:
    """One agent's control socket."""

    pid: int
    path: str


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


_refused_noted: set[str] = set()


def foreign_runtime_dir(d: str) -> str | None:
    """Why the sockets in ``d`` cannot be trusted (None: they can, or ``d`` does not exist).

    ``/tmp/aiprof-<uid>`` must belong to that uid (root lists everyone's); any other folder to
    us. A folder another user pre-created would hand them our capture requests."""
    m = re.fullmatch(r"aiprof-(\d+)", os.path.basename(d.rstrip("/"))) if os.path.dirname(d.rstrip("/")) == "/tmp" \
        else None
    try:
        check_private_dir(d, int(m.group(1)) if m else None)
    except FileNotFoundError:
        return None
    except UnsafePath as exc:
        return str(exc)
    except OSError:
        return None  # unreadable (another user's 0700 folder): nothing in it will be found anyway
    return None


def discover(rt_dirs: list[str] | None = None) -> list[Endpoint]:
    """Every agent socket in the runtime folders (default: ours; all users' when root)."""
    if rt_dirs is None:
        rt_dirs = [runtime_dir()]
        if os.geteuid() == 0 and "AIPROF_RUNTIME_DIR" not in os.environ:
            rt_dirs += [d for d in glob.glob("/tmp/aiprof-*") if d not in rt_dirs]
    out: list[Endpoint] = []
    for d in rt_dirs:
        why = foreign_runtime_dir(d)
        if why:
            if d not in _refused_noted:  # once per folder: clients call discover() in loops
                _refused_noted.add(d)
                print(f"aiprof: ignoring the runtime folder {why}: its sockets could be anyone's (remove it)",
                      file=sys.stderr)
            continue
        for p in sorted(glob.glob(os.path.join(d, "agent-*.sock"))):
            try:
                pid = int(os.path.basename(p)[len("agent-"):-len(".sock")])
            except ValueError:
                continue
            if not _pid_alive(pid):
                try:
                    os.unlink(p)
                except OSError:
                    pass
                continue
            out.append(Endpoint(pid, p))
    return out


def connect(ep: Endpoint, timeout: float = 2.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(ep.path)
    return s


def status(ep: Endpoint, timeout: float = 2.0) -> dict | None:
    """Ask one agent for its status; None if it does not answer in time."""
    try:
        with connect(ep, timeout) as s:
            _send(s, {"op": "status"})
            return _read_line(s, timeout)
    except OSError:
        return None


def ask(ep: Endpoint, op: str, timeout: float = 5.0) -> dict | None:
    """Send one simple request (``collectives``, ``stacks``) and return the reply; None on failure."""
    try:
        with connect(ep, timeout) as s:
            _send(s, {"op": op})
            return _read_line(s, timeout)
    except (OSError, ValueError):
        return None


def wait_for_socket(path: str, timeout: float) -> bool:
    """Wait until an agent's socket exists (after injection); bounded."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def capture_all(eps: list[Endpoint], req: CaptureRequest | dict[int, CaptureRequest], timeout: float) -> dict[int, dict]:
    """Send a capture request to every endpoint and wait (bounded) for each one's result.

    ``req`` is one request for all, or one per pid (aligned start iterations differ by job).
    Returns pid -> {"ok", "dir", "error", ...}.
    """
    results: dict[int, dict] = {}
    lock = threading.Lock()

    def one(ep: Endpoint) -> None:
        r = req[ep.pid] if isinstance(req, dict) else req
        res: dict[str, Any]
        try:
            with connect(ep, 5.0) as s:
                _send(s, {"op": "capture", "request": r.to_dict()})
                ack = _read_line(s, 5.0)
                if not ack or not ack.get("accepted"):
                    res = {"ok": False, "dir": None, "error": (ack or {}).get("error", "no answer from agent")}
                else:
                    done = _read_line(s, timeout)
                    res = done if done else {"ok": False, "dir": None,
                                             "error": f"no result within {timeout:.0f} s (the capture may still finish)"}
        except OSError as exc:
            res = {"ok": False, "dir": None, "error": f"cannot reach agent: {exc}"}
        with lock:
            results[ep.pid] = res

    threads = [threading.Thread(target=one, args=(ep,), daemon=True) for ep in eps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 15)
    for ep in eps:
        results.setdefault(ep.pid, {"ok": False, "dir": None, "error": "timed out"})
    return results
