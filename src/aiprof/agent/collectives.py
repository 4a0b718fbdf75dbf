"""Collective flight recorder: the last collectives this process entered, for hang snapshots.

Two sources, both bounded:

* **Python wrappers** (always, once installed): the public ``torch.distributed`` collective entry
  points (``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``, ``send``/``recv``...) are
  replaced by thin wrappers that append one entry to a ring buffer (:data:`RING_SIZE`) *before*
  calling the original, and mark it returned after. A rank blocked inside a gloo collective
  therefore shows an entry that never returned. The sequence number is the process group's own
  (``ProcessGroup._get_sequence_number_for_group()`` + 1, read before the call), so it matches
  across ranks and with the flight recorder below, also when the agent was attached late.
  They do not see collectives that C++ issues directly: DDP's gradient all-reduce goes from its
  C++ reducer to the ProcessGroup.
* **torch's flight recorder** (torch >= 2.2 for NCCL; gloo too on recent torch): C++ records
  every collective the ProcessGroup runs, DDP's included, with its state. The agent turns it
  on (``TORCH_FR_BUFFER_SIZE``, ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.9) when it
  starts before the job creates its process group and the user has not set it, and reads it with
  ``torch._C._distributed_c10d._dump_fr_trace_json`` (or the older ``_dump_nccl_trace*``).
  ``AIPROF_FLIGHT_RECORDER=0`` leaves it alone.

:func:`snapshot` returns ``{"python": [...], "flight_recorder": [...] | None, ...}`` (schema in
docs/report.md, "Hang snapshot"). Nothing here raises into the job: a failed record is counted
in ``Recorder.failures`` and the user's call goes on.
"""
from __future__ import annotations

import collections
import functools
import inspect
import json
import os
import pickle
import threading
import time
from typing import Any, Callable

from aiprof.agent import log

RING_SIZE = 64  # entries the Python wrappers keep (oldest dropped first)
REPORT_LAST = 16  # entries per source a snapshot reports
FR_BUFFER_ENTRIES = 256  # flight recorder size the agent asks for (one buffer per process)
FR_DUMP_TIMEOUT_S = 3.0  # a dump runs on a helper thread: a wedged communicator must not hold us
ENV_OFF = "AIPROF_FLIGHT_RECORDER"

# public entry points -> whether they are point-to-point (their seq is not comparable across ranks)
WRAPPED: dict[str, bool] = {
    "all_reduce": False, "all_gather": False, "all_gather_into_tensor": False, "all_gather_object": False,
    "reduce_scatter": False, "reduce_scatter_tensor": False, "all_to_all": False, "all_to_all_single": False,
    "broadcast": False, "broadcast_object_list": False, "reduce": False, "gather": False, "scatter": False,
    "barrier": False, "send": True, "recv": True, "isend": True, "irecv": True, "batch_isend_irecv": True,
}

# entry slots (a list, not a dict: one allocation per call)
_SEQ, _OP, _PG, _PGSIZE, _SHAPE, _DTYPE, _T, _RET, _STATE, _WORK, _P2P, _PEER, _N = range(13)


class Recorder:
    """Ring buffer of the collectives this process entered through the Python API."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.ring: collections.deque[list] = collections.deque(maxlen=size)
        self.failures = 0  # records that failed (the user's call went on regardless)
        self.calls = 0
        self._pgs: dict[int, tuple[Any, str, int]] = {}  # id(pg) -> (pg, name, size)
        self._own_seq: dict[str, int] = {}  # fallback when the group exposes no sequence number

    def _pg_info(self, pg: Any) -> tuple[str, int]:
        hit = self._pgs.get(id(pg))
        if hit is not None and hit[0] is pg:
            return hit[1], hit[2]
        name = str(getattr(pg, "group_name", "") or id(pg))
        size = int(pg.size())
        if len(self._pgs) > 1024:  # groups created and dropped in a loop: keep the cache bounded
            self._pgs.clear()
        self._pgs[id(pg)] = (pg, name, size)
        return name, size

    def enter(self, op: str, pg: Any, first: Any, p2p: bool, peer: Any) -> list:
        """Append the entry of a call about to start; returns it (the wrapper marks it returned)."""
        name, size = self._pg_info(pg)
        try:
            seq = int(pg._get_sequence_number_for_group()) + 1
        except Exception:
            seq = self._own_seq.get(name, 0) + 1
            self._own_seq[name] = seq
        shape = dtype = None
        t = first[0] if isinstance(first, (list, tuple)) and first else first
        if t is not None and hasattr(t, "shape"):
            shape, dtype = t.shape, t.dtype
        e = [seq, op, name, size, shape, dtype, time.time_ns(), None, "entered", None, p2p, peer]
        self.ring.append(e)
        self.calls += 1
        return e

    def entries(self, last: int = REPORT_LAST) -> list[dict[str, Any]]:
        """The last ``last`` entries, oldest first, as plain data (async work polled now)."""
        out = []
        for e in list(self.ring)[-last:]:
            state, work = e[_STATE], e[_WORK]
            if work is not None:
                try:
                    if work.is_completed():
                        e[_STATE], e[_WORK] = "completed", None  # drop the reference once done
                        state = "completed"
                except Exception:
                    pass
            out.append({"seq": e[_SEQ], "op": e[_OP], "pg": e[_PG], "pg_size": e[_PGSIZE],
                        "shape": None if e[_SHAPE] is None else list(e[_SHAPE]),
                        "dtype": None if e[_DTYPE] is None else str(e[_DTYPE]).replace("torch.", ""),
                        "t_ns": e[_T], "returned_ns": e[_RET], "state": state, "p2p": e[_P2P],
                        "peer": e[_PEER]})
        return out


RECORDER = Recorder()
# threads inside a wrapped call: all_gather_object calls all_gather; record the outer call only
# (a set of thread ids: cheaper than a threading.local attribute, which costs ~0.4 us)
_INSIDE: set[int] = set()


def _group_index(fn: Callable) -> tuple[int | None, int | None]:
    """Positional indexes of ``group`` and of the peer (dst/src) in ``fn``'s signature."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None, None
    g = names.index("group") if "group" in names else None
    p = next((names.index(n) for n in ("dst", "src") if n in names), None)
    return g, p


def _make_wrapper(op: str, orig: Callable, c10d: Any, p2p: bool) -> Callable:
    g_idx, p_idx = _group_index(orig)
    rec = RECORDER
    inside, get_ident = _INSIDE, threading.get_ident
    try:
        from torch.compiler import is_compiling
    except Exception:  # older torch
        def is_compiling() -> bool:
            return False

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # under torch.compile, dynamo traces this body: go straight to the original (no graph break)
        tid = get_ident()
        if is_compiling() or tid in inside:
            return orig(*args, **kwargs)
        entry = None
        try:
            if op == "batch_isend_irecv":
                ops = args[0] if args else kwargs.get("p2p_op_list") or []
                pg = getattr(ops[0], "group", None) if ops else None
                first = [o.tensor for o in ops[:1]]
                peer = None
            else:
                pg = kwargs.get("group") if "group" in kwargs else (
                    args[g_idx] if g_idx is not None and g_idx < len(args) else None)
                first = args[0] if args else next(iter(kwargs.values()), None)
                peer = kwargs.get("dst", kwargs.get("src")) if p_idx is None or p_idx >= len(args) else args[p_idx]
            if pg is None:
                pg = c10d._get_default_group()
            entry = rec.enter(op, pg, first, p2p, peer)
        except Exception:
            rec.failures += 1
        inside.add(tid)
        try:
            res = orig(*args, **kwargs)
        except BaseException:
            if entry is not None:
                entry[_STATE] = "raised"
            raise
        finally:
            inside.discard(tid)
        if entry is not None:
            try:
                entry[_RET] = time.time_ns()
                if res is not None and hasattr(res, "is_completed"):  # async_op=True: a Work
                    entry[_STATE], entry[_WORK] = "pending", res
                else:
                    entry[_STATE] = "returned"
            except Exception:
                rec.failures += 1
        return res

    wrapper.__aiprof_orig__ = orig  # type: ignore[attr-defined]
    return wrapper


_INSTALLED = False
_FR_ENABLED_BY_US: str | None = None


def _enable_flight_recorder(torch: Any, dist: Any, origin: str) -> None:
    """Ask torch's flight recorder to record, if nobody decided otherwise and it is not too late."""
    global _FR_ENABLED_BY_US
    if os.environ.get(ENV_OFF, "1").strip().lower() in ("0", "false", "off", "no"):
        return
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    if any(os.environ.get(n) for n in names) or origin != "run":
        return  # the user chose; or attached: the process group probably exists and read it already
    try:
        if dist.is_initialized():
            return
    except Exception:
        return
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except Exception:
        major, minor = 2, 0
    var = names[0] if (major, minor) >= (2, 9) else names[1]  # torch 2.9 renamed it (the old name warns)
    os.environ[var] = str(FR_BUFFER_ENTRIES)
    _FR_ENABLED_BY_US = var


def install(origin: str = "run") -> bool:
    """Wrap the collectives of ``torch.distributed`` (once per process); never raises."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import sys

        torch = sys.modules.get("torch")
        if torch is None:
            return False
        import torch.distributed as dist

        if not dist.is_available():
            return False
        from torch.distributed import distributed_c10d as c10d

        _enable_flight_recorder(torch, dist, origin)
        n = 0
        for op, p2p in WRAPPED.items():
            orig = getattr(c10d, op, None)
            if orig is None or hasattr(orig, "__aiprof_orig__"):
                continue
            w = _make_wrapper(op, orig, c10d, p2p)
            setattr(c10d, op, w)
            if getattr(dist, op, None) is orig:  # `dist.all_reduce` is what user code calls
                setattr(dist, op, w)
            n += 1
        _INSTALLED = True
        log.info(f"collective recorder: {n} entry points wrapped"
                 + (f"; flight recorder on ({_FR_ENABLED_BY_US}={FR_BUFFER_ENTRIES})" if _FR_ENABLED_BY_US else ""))
        return True
    except Exception as exc:
        log.error("collective recorder install", exc)
        return False


def uninstall() -> None:
    """Put the original functions back (tests)."""
    global _INSTALLED
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        return
    for op in WRAPPED:
        for mod in (c10d, dist):
            f = getattr(mod, op, None)
            if f is not None and hasattr(f, "__aiprof_orig__"):
                setattr(mod, op, f.__aiprof_orig__)
    _INSTALLED = False


# -- torch's flight recorder ------------------------------------------------------------------------


def _fr_entry(e: dict[str, Any]) -> dict[str, Any]:
    p2p = bool(e.get("is_p2p"))
    pg = e.get("process_group") or ["", ""]
    op = str(e.get("profiling_name") or "").split(":")[-1]
    return {"seq": e.get("p2p_seq_id") if p2p else e.get("collective_seq_id"), "op": op,
            "pg": str(pg[0]), "pg_desc": str(pg[1]) if len(pg) > 1 else "",
            "shape": (e.get("input_sizes") or [None])[0], "dtype": (e.get("input_dtypes") or [None])[0],
            "t_ns": e.get("time_created_ns"), "state": e.get("state"), "retired": e.get("retired"),
            "started_ns": e.get("time_discovered_started_ns") or None,
            "completed_ns": e.get("time_discovered_completed_ns") or None, "p2p": p2p}


def _dump_fr() -> list[dict[str, Any]] | None:
    """Entries of every flight recorder this torch has, merged; None when it has none.

    NCCL's recorder (``_dump_nccl_trace*``) and the generic one that gloo uses
    (``_dump_fr_trace*``, torch >= 2.8) are separate instances: on torch 2.11 with NCCL the
    generic one is empty (seen on H200s), so both are read.
    """
    import torch._C._distributed_c10d as c

    found = False
    entries: list[dict[str, Any]] = []
    for js, pk in (("_dump_nccl_trace_json", "_dump_nccl_trace"), ("_dump_fr_trace_json", "_dump_fr_trace")):
        fn = getattr(c, js, None)
        if fn is not None:
            data = json.loads(fn(True, False))
        elif getattr(c, pk, None) is not None:
            data = pickle.loads(getattr(c, pk)(True, False, False))
        else:
            continue
        found = True
        entries += data.get("entries") or []
    if not found:
        return None
    out = [_fr_entry(e) for e in entries]
    out.sort(key=lambda e: (e.get("t_ns") or 0))
    return out[-REPORT_LAST:]


_fr_lock = threading.Lock()


def flight_recorder(timeout: float = FR_DUMP_TIMEOUT_S) -> tuple[list[dict[str, Any]] | None, str | None]:
    """torch's flight recorder entries (last :data:`REPORT_LAST`), or (None, why not)."""
    import sys

    if "torch" not in sys.modules:
        return None, "torch not imported"
    if not _fr_lock.acquire(blocking=False):
        return None, "an earlier dump is still running"
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["v"] = _dump_fr()
        except Exception as exc:
            box["e"] = f"{type(exc).__name__}: {exc}"
        finally:
            _fr_lock.release()

    t = threading.Thread(target=run, name="aiprof-fr-dump", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return None, f"flight recorder dump did not return within {timeout:.0f} s"
    if "e" in box:
        return None, box["e"]
    if box.get("v") is None:
        return None, "this torch has no flight recorder"
    return box["v"], None


def snapshot(last: int = REPORT_LAST) -> dict[str, Any]:
    """What this process reports in a hang snapshot: its last collectives from each source."""
    out: dict[str, Any] = {"installed": _INSTALLED, "python": [], "flight_recorder": None, "fr_error": None,
                           "fr_enabled_by": _FR_ENABLED_BY_US, "failures": RECORDER.failures}
    try:
        out["python"] = RECORDER.entries(last)
    except Exception as exc:
        out["python_error"] = f"{type(exc).__name__}: {exc}"
    try:
        fr, err = flight_recorder()
        out["flight_recorder"], out["fr_error"] = fr, err
    except Exception as exc:
        out["fr_error"] = f"{type(exc).__name__}: {exc}"
    return out
