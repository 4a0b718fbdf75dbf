"""The dependency graph of a rank's analysed steps, for the what-if replay (docs/findings.md).

What decides when a step ends is a small set of dependencies, and the trace holds all of them:

* **The host lane.** Every CUDA runtime/driver call is an *action*. Host threads are merged into
  one lane ordered by time (the training thread, the autograd thread and the collective threads
  hand work to each other; they rarely launch in parallel). Between two actions the host does
  *intrinsic* work (Python, op dispatch): its duration is kept, minus the profiler's own cost.
* **Launches.** A kernel/copy starts when its stream is free, its launch call has been made
  (plus the launch latency measured on this trace) and any cross-stream wait is satisfied.
* **Blocking calls.** A sync call (device/stream/event synchronize, ``cudaFree``, a synchronous
  copy) returns once the GPU op it waited for has finished, plus its own cost.
* **Steps.** A marker action at the start of every step, so the replay can time each step.

:func:`build_graph` turns a :class:`~aiprof.trace.store.RankTrace` into these arrays once;
:mod:`aiprof.diagnosis.replay` simulates them, with or without a cause's edit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiprof import npx
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.steps import Steps
from aiprof.diagnosis.profiler_cost import DEFAULT, MIN_KEPT_SHARE, ProfilerCost
from aiprof.trace import classify
from aiprof.trace.store import RankTrace

# the markers (STEP and after) come after the bulk kinds: replay.simulate tests `kind >= STEP` once
OTHER, LAUNCH, SYNC, STEP, END, COLL_START, COLL_END = 0, 1, 2, 3, 4, 5, 6
# CPU and GPU timestamps come from different clocks that CUPTI aligns to within microseconds:
# a sync is taken to have waited for an op that ended at most this long after it returned.
SYNC_CLOCK_TOL_NS = 5_000
# An op that starts this much later than it could have, right as an op of another stream ends,
# waited for that op (graph._implicit_waits): far beyond launch jitter (a few µs).
IMPLICIT_WAIT_MIN_NS = 50_000
# A stream that waits for another's event starts a few µs after that event's op ends: 5.6-5.8 µs
# measured on an H100 (FSDP2's compute stream after its all-gather copy-out); up to this long.
IMPLICIT_WAIT_TOL_NS = 20_000
# Launch latency when the trace has no op that started on an idle stream (typical of CUDA on
# Hopper with a warm context: a few microseconds from the launch call to the kernel's start).
DEFAULT_LAUNCH_LATENCY_NS = 5_000.0
# The launch latency is the fastest launch-to-start this trace shows on an idle stream: a low
# percentile, so that ops delayed by other work on the GPU do not inflate it; with fewer samples
# than this the default above is used.
LATENCY_PERCENTILE = 10
MIN_LATENCY_SAMPLES = 5
# A launch whose op started at least this long after the call returned was made while the GPU
# ran a backlog (a millisecond of queued work: far beyond the launch latency of a few µs) ...
QUEUE_BACKLOG_MIN_NS = 1_000_000
# ... and one that took this much longer than the unblocked launches of its API waited for a
# slot in the full launch queue (launch calls cost 2-20 µs, profiled up to ~50 µs).
QUEUE_BLOCK_MIN_EXCESS_NS = 100_000
# A launch call's own host cost when the trace has no unblocked launch to measure it by.
DEFAULT_LAUNCH_COST_NS = 5_000.0
# Calls that replay a CUDA graph: one call, many ops on several streams (graph._graph_order).
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
# Calls that wait for every GPU op issued before them: explicit device syncs, and freeing
# device memory, which the CUDA runtime does only after the device is idle.
DEVICE_WIDE_WAITS = frozenset({"cudaDeviceSynchronize", "cuCtxSynchronize", "cudaFree", "cuMemFree", "cudaFreeHost",
                               "cuMemFreeHost", "cudaFreeArray"})
# Copy calls: they block when the copy involves pageable memory or is synchronous by API.
_COPY_PREFIXES = ("cudaMemcpy", "cuMemcpy")


def _base(name: str) -> str:
    return name.split("_v", 1)[0] if name.startswith("cu") else name


def is_graph_launch(name: str) -> bool:
    """Whether a runtime/driver call replays a CUDA graph."""
    return _base(name) in GRAPH_LAUNCHES


@dataclass
class Graph:
    """One rank's analysed window as a replayable graph (times in ns on the rank's clock)."""

    rank: int
    lo: int  # window start (first step's start)
    hi: int  # window end (last step's end)
    step_number: np.ndarray  # step numbers, in order
    # actions, in host order
    a_ts: np.ndarray
    a_end: np.ndarray
    a_kind: np.ndarray  # OTHER | LAUNCH | SYNC | STEP | END
    a_row: np.ndarray  # runtime row (-1 for markers)
    a_wait: np.ndarray  # op awaited before the action returns (-1: none)
    a_name: list[str]  # runtime call name per distinct code (a_code indexes it)
    a_code: np.ndarray
    gap: np.ndarray  # intrinsic host ns before the action (deflated); may be negative (overlap)
    cost: np.ndarray  # the action's own host ns, waiting excluded (deflated)
    gap_raw: np.ndarray  # the same, as profiled
    cost_raw: np.ndarray
    over: np.ndarray  # profiler cost of the events recorded in each gap (per-event model, ns)
    rt_over: np.ndarray  # profiler cost inside each call
    # GPU ops, in launch order
    o_action: np.ndarray  # launching action
    o_stream: np.ndarray
    o_dur: np.ndarray
    o_ts: np.ndarray  # original start
    o_end: np.ndarray  # original end
    o_delay: np.ndarray  # unexplained extra delay before the op started (kept by the replay)
    o_table: np.ndarray  # 0 kernels, 1 memops
    o_row: np.ndarray  # row in that table
    o_deps: dict = field(default_factory=dict)  # op -> [ops on other streams it waits for]
    launch_latency_ns: float = DEFAULT_LAUNCH_LATENCY_NS
    profiler: ProfilerCost = DEFAULT
    alpha: float = 0.0  # multiplier of the per-event profiler cost applied (see deflate)
    beta: float = 1.0  # uniform host-time scale applied on top
    # collectives matched across ranks (job id per action/op, -1: none)
    a_coll: np.ndarray | None = None  # COLL_START / COLL_END markers of host-side collectives
    o_coll: np.ndarray | None = None  # GPU collective kernels
    c_others: dict = field(default_factory=dict)  # id -> latest other rank's arrival (this rank's clock)
    c_transfer: dict = field(default_factory=dict)  # id -> ns the collective takes once all arrived

    @property
    def deflated_ns(self) -> float:
        """Host ns removed as the profiler's cost over the window."""
        pos = self.gap_raw > 0
        return float((self.gap_raw[pos] - self.gap[pos]).sum() + (self.cost_raw - self.cost).sum())

    def deflate(self, alpha: float, beta: float = 1.0) -> None:
        """Set the replayed host time: the recorded gaps and call costs minus ``alpha`` times the
        profiler's per-event cost (never below MIN_KEPT_SHARE of the recording), times ``beta``.
        alpha = 1 is the measured per-event model; the calibration fits alpha, then beta, to the
        unprofiled step time when the capture knows it."""
        pos = self.gap_raw > 0
        gap = self.gap_raw.copy()
        gap[pos] = np.maximum(self.gap_raw[pos] - alpha * self.over[pos], MIN_KEPT_SHARE * self.gap_raw[pos]) * beta
        cost = np.maximum(self.cost_raw - alpha * self.rt_over, MIN_KEPT_SHARE * self.cost_raw) * beta
        self.gap, self.cost, self.alpha, self.beta = gap, cost, alpha, beta

    @property
    def n_actions(self) -> int:
        return len(self.a_ts)

    @property
    def n_ops(self) -> int:
        return len(self.o_dur)

    def action_name(self, i: int) -> str:
        c = int(self.a_code[i])
        return self.a_name[c] if c >= 0 else ""

    def ops_of_rows(self, table: int, rows: np.ndarray) -> np.ndarray:
        """Op indices of the given rows of the kernels (0) or memops (1) table."""
        m = (self.o_table == table) & np.isin(self.o_row, rows)
        return np.nonzero(m)[0]


def queue_wait_ns(a_ts: np.ndarray, a_end: np.ndarray, a_kind: np.ndarray, a_wait: np.ndarray, a_code: np.ndarray,
                  o_action: np.ndarray, o_ts: np.ndarray) -> np.ndarray:
    """Per action, the host ns a launch spent blocked on a full launch queue (0 elsewhere).

    The CUDA driver queues a bounded number of launches (about a thousand); once the GPU is that
    far behind, each launch call waits for the GPU to retire work before it returns. Such a call
    is recognised by its own op starting long after the call returned (the GPU had a backlog,
    :data:`QUEUE_BACKLOG_MIN_NS`) and by the call taking far longer than this trace's unblocked
    launches of the same API (:data:`QUEUE_BLOCK_MIN_EXCESS_NS`). Its excess is waiting for the
    GPU, not host work: the replay keeps only the typical cost, so a fix that shortens the GPU's
    work is not held back by the host time the slow GPU caused."""
    out = np.zeros(len(a_ts))
    if not len(o_action):
        return out
    launch = np.nonzero((a_kind == LAUNCH) & (a_wait < 0))[0]
    if not len(launch):
        return out
    first_op = np.searchsorted(o_action, launch, side="left")
    dur = (a_end[launch] - a_ts[launch]).astype(np.float64)
    backlog = o_ts[first_op] - a_end[launch]
    queued = backlog >= QUEUE_BACKLOG_MIN_NS
    code = a_code[launch]
    typical = np.full(len(launch), DEFAULT_LAUNCH_COST_NS)
    if (~queued).any():
        typical[:] = float(np.median(dur[~queued]))
        for c in np.unique(code[queued]):
            same = (code == c) & ~queued
            if same.sum() >= MIN_LATENCY_SAMPLES:
                typical[code == c] = float(np.median(dur[same]))
    blocked = queued & (dur - typical >= QUEUE_BLOCK_MIN_EXCESS_NS)
    out[launch[blocked]] = dur[blocked] - typical[blocked]
    return out


def _backlog_wait_ns(rt: RankTrace, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For sync calls that waited for none of the window's own ops: how long each waited for GPU
    work launched before the window (until the latest op of the trace that ended before the
    call returned). That is waiting for a backlog the replay does not have (it starts from an
    idle GPU), not host work: a capture that starts while the GPU is behind, with a sync early
    in its first step, would otherwise replay the backlog as host time no fix removes."""
    parts = [t["ts"] + t["dur"] for t in (rt.table("kernels"), rt.table("memops")) if len(t)]
    if not len(ts) or not parts:
        return np.zeros(len(ts))
    ends = np.sort(np.concatenate(parts))
    pos = np.searchsorted(ends, end + SYNC_CLOCK_TOL_NS, side="right") - 1
    last = np.where(pos >= 0, ends[np.maximum(pos, 0)], ts)
    return np.clip(np.minimum(last, end) - ts, 0, None).astype(np.float64)


def _host_event_starts(rt: RankTrace, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Start times inside the window of recorded torch ops/annotations, Python function events
    and builtin (C function) events; and whether input shapes were recorded."""
    parts = []
    shapes = False
    for name in ("ops", "annotations"):
        t = rt.table(name)
        if len(t):
            ts = t["ts"]
            keep = (ts >= lo) & (ts < hi)
            if name == "annotations":
                keep &= ~t["gpu"]
            if name == "ops" and "input_dims" in t:
                dims = t.strings("input_dims")
                shapes = any(s not in ("", "[]") for s in dims.labels)
            parts.append(ts[keep])
    ops = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    py = rt.table("python")
    if not len(py):
        z = np.zeros(0, np.int64)
        return ops, z, z, shapes
    keep = (py["ts"] >= lo) & (py["ts"] < hi)
    builtin = py.strings("name").isin_labels(lambda s: s.startswith("<built-in"))
    return ops, np.sort(py["ts"][keep & ~builtin]), np.sort(py["ts"][keep & builtin]), shapes


def _implicit_waits(o_ts: np.ndarray, o_end: np.ndarray, o_stream: np.ndarray, ready: np.ndarray,
                    first: np.ndarray) -> dict[int, int]:
    """Cross-stream waits the calls do not show: an op that started IMPLICIT_WAIT_MIN_NS or more
    after it could have (its stream free, its launch made) at the instant an op of another
    stream, launched before it, ended (at most IMPLICIT_WAIT_TOL_NS before) waited for that op. FSDP's
    optimizer kernels wait so for the reduce-scatter on its own stream (an event waited for long
    before their launch, with other launches between: the next op after the wait call is not the
    one that waits). Returns op -> the op it waited for."""
    out: dict[int, int] = {}
    late = np.nonzero(~first & (o_ts - ready >= IMPLICIT_WAIT_MIN_NS))[0]
    if not len(late):
        return out
    by_end = np.argsort(o_end, kind="stable")
    ends = o_end[by_end]
    for j in late.tolist():
        lo = np.searchsorted(ends, o_ts[j] - IMPLICIT_WAIT_TOL_NS, side="left")
        hi = np.searchsorted(ends, o_ts[j] + SYNC_CLOCK_TOL_NS, side="right")
        cand = by_end[lo:hi]
        cand = cand[(cand < j) & (o_stream[cand] != o_stream[j])]
        if len(cand):
            out[j] = int(cand[np.argmax(o_end[cand])])
    return out


def _graph_order(o_action: np.ndarray, o_stream: np.ndarray, o_ts: np.ndarray, o_end: np.ndarray,
                 graph_action: np.ndarray) -> dict[int, list[int]]:
    """Dependencies inside a CUDA graph, which no call records: the graph's nodes run on several
    streams, ordered by its edges. Each op a graph launch runs waits, as recorded, for the op of
    that launch on another stream that ended last before it started (a backward graph's branches
    ran one after another: replayed side by side they took 23 of the measured 27 ms a step, and
    the calibration then took the missing time for host work). Returns op -> [ops it waits for]."""
    out: dict[int, list[int]] = {}
    graph_ops = np.nonzero(graph_action[o_action])[0] if len(o_action) else np.zeros(0, np.int64)
    if not len(graph_ops):
        return out
    bounds = np.nonzero(np.diff(o_action[graph_ops]))[0] + 1
    for ops in np.split(graph_ops, bounds):  # the ops of one graph launch
        streams = np.unique(o_stream[ops])
        if len(streams) < 2:
            continue
        for s in streams.tolist():
            mine, other = ops[o_stream[ops] == s], ops[o_stream[ops] != s]
            by_end = other[np.argsort(o_end[other], kind="stable")]
            k = np.searchsorted(o_end[by_end], o_ts[mine] + SYNC_CLOCK_TOL_NS, side="right") - 1
            for j, i in zip(mine.tolist(), k.tolist()):
                if i >= 0:
                    out[j] = [int(by_end[i])]
    return out


@dataclass
class RankCollectives:
    """This rank's collectives matched across the job: job-wide id, recorded start/end, whether
    they run on the host (a backend thread: gloo) or as GPU kernels, and the coupling facts."""

    ids: np.ndarray
    start: np.ndarray
    end: np.ndarray
    host: bool
    others: dict  # id -> latest arrival of the other ranks (ns, this rank's clock; recorded)
    transfer: dict  # id -> ns from the last arrival to the end (the last arriver's duration)


def build_graph(rt: RankTrace, steps: Steps, profiler: ProfilerCost = DEFAULT,
                colls: RankCollectives | None = None) -> Graph:
    """The replay graph of ``rt`` over its analysed steps (see the module docstring); with
    ``colls``, collectives couple it to the other ranks."""
    lo = int(steps.start.min()) if len(steps) else 0
    hi = int(steps.end.max()) if len(steps) else 0
    r = rt.runtime
    if len(r):
        rmask = (r["ts"] >= lo) & (r["ts"] < hi)
        rrows = np.nonzero(rmask)[0]
        names = r.strings("name")
        r_ts, r_end, r_code = r["ts"][rrows], (r["ts"] + r["dur"])[rrows], names.codes[rrows].astype(np.int64)
        labels = list(names.labels)
    else:
        rrows = np.zeros(0, np.int64)
        r_ts = r_end = r_code = np.zeros(0, np.int64)
        labels = []
    # markers: one per step start, one at the window end, and a start and an end marker per
    # host-side collective
    n_st = len(steps)
    m_ts = np.concatenate([steps.start.astype(np.int64), [hi]])
    m_kind = np.concatenate([np.full(n_st, STEP, np.int8), [END]]).astype(np.int8)
    m_coll = np.full(len(m_ts), -1, np.int64)
    if colls is not None and colls.host and len(colls.ids):
        inw = (colls.start >= lo) & (colls.start < hi)
        cs, ce, ci = colls.start[inw], np.minimum(colls.end[inw], hi), colls.ids[inw]
        m_ts = np.concatenate([m_ts, cs, ce])
        m_kind = np.concatenate([m_kind, np.full(len(cs), COLL_START, np.int8), np.full(len(ce), COLL_END, np.int8)])
        m_coll = np.concatenate([m_coll, ci, ci])
    a_ts = np.concatenate([r_ts, m_ts])
    a_end = np.concatenate([r_end, m_ts])
    a_kind = np.concatenate([np.full(len(rrows), OTHER, np.int8), m_kind])
    a_row = np.concatenate([rrows, np.full(len(m_ts), -1, np.int64)])
    a_code = np.concatenate([r_code, np.full(len(m_ts), -1, np.int64)])
    a_coll = np.concatenate([np.full(len(rrows), -1, np.int64), m_coll])
    # markers sort before calls starting at the same instant (the step starts, then its first call)
    order = np.lexsort((a_row >= 0, a_ts))
    a_ts, a_end, a_kind, a_row, a_code, a_coll = (a_ts[order], a_end[order], a_kind[order], a_row[order],
                                                  a_code[order], a_coll[order])
    act_of_row = np.full(len(r), -1, np.int64)
    real = a_row >= 0
    act_of_row[a_row[real]] = np.nonzero(real)[0]

    # GPU ops launched by the window's calls
    o_parts = []
    for ti, tname in enumerate(("kernels", "memops")):
        g = rt.table(tname)
        if not len(g):
            continue
        lr = launch_rows(r, g) if len(r) else np.full(len(g), -1, np.int64)
        ok = lr >= 0
        act = np.full(len(g), -1, np.int64)
        act[ok] = act_of_row[lr[ok]]
        sel = np.nonzero(act >= 0)[0]
        if len(sel):
            dev = g["device"][sel] if "device" in g else np.zeros(len(sel), np.int64)
            o_parts.append((ti, sel, act[sel], g["stream"][sel], g["ts"][sel], g["dur"][sel], dev))
    if o_parts:
        # a stream is a (device, stream id) pair: one process may drive several GPUs (DataParallel),
        # each with its own default stream 7; one device's keys stay its stream ids
        devs = np.concatenate([p[6] for p in o_parts]).astype(np.int64)
        sids = np.concatenate([p[3] for p in o_parts]).astype(np.int64)
        _, dev_index = npx.unique(devs, return_inverse=True)
        stride = int(sids.max()) + 1 if len(sids) else 1
        o_table = np.concatenate([np.full(len(p[1]), p[0], np.int8) for p in o_parts])
        o_row = np.concatenate([p[1] for p in o_parts])
        o_action = np.concatenate([p[2] for p in o_parts])
        o_stream = sids + dev_index.astype(np.int64) * stride
        o_ts = np.concatenate([p[4] for p in o_parts]).astype(np.int64)
        o_dur = np.concatenate([p[5] for p in o_parts]).astype(np.float64)
        order = np.lexsort((o_ts, o_action))
        o_table, o_row, o_action, o_stream, o_ts, o_dur = (o_table[order], o_row[order], o_action[order],
                                                           o_stream[order], o_ts[order], o_dur[order])
    else:
        o_table = np.zeros(0, np.int8)
        o_row = o_action = o_stream = o_ts = np.zeros(0, np.int64)
        o_dur = np.zeros(0)
    o_end = o_ts + o_dur.astype(np.int64)
    n_act, n_op = len(a_ts), len(o_dur)
    a_kind[o_action] = LAUNCH

    # which op each blocking call waited for
    a_wait = np.full(n_act, -1, np.int64)
    is_dev = np.array([_base(s) in DEVICE_WIDE_WAITS for s in labels] + [False], dtype=bool)
    is_sync = np.array([classify.is_sync_call(s) for s in labels] + [False], dtype=bool)
    is_copy = np.array([s.startswith(_COPY_PREFIXES) for s in labels] + [False], dtype=bool)
    is_graph = np.array([is_graph_launch(s) for s in labels] + [False], dtype=bool)
    code = np.where(a_code >= 0, a_code, len(labels))
    if n_op:
        # ops launched by earlier actions, by end time, to find the one a sync returned after
        by_end = np.argsort(o_end, kind="stable")
        ends_sorted = o_end[by_end]
        # latest end among ops launched by actions before i (prefix max over launch order)
        pre_max = np.maximum.accumulate(o_end)
        # prefix argmax: the latest op that reached the running maximum
        pre_arg = np.maximum.accumulate(np.where(o_end == pre_max, np.arange(n_op), 0))
        first_op_after = np.searchsorted(o_action, np.arange(n_act), side="left")  # ops of actions >= i
        for i in np.nonzero((is_sync[code] | is_dev[code]) & (a_row >= 0))[0]:
            k = first_op_after[i]  # ops [0, k) were launched before action i
            if k == 0:
                continue
            if is_dev[code[i]]:
                a_wait[i] = pre_arg[k - 1]
                continue
            # the latest-ending earlier op that ended before the call returned
            pos = np.searchsorted(ends_sorted, a_end[i] + SYNC_CLOCK_TOL_NS, side="right") - 1
            while pos >= 0 and o_action[by_end[pos]] >= i:
                pos -= 1
            if pos >= 0 and pre_max[k - 1] > 0:
                a_wait[i] = by_end[pos]
        # synchronous copies: the call returned only after its own copy finished
        last_op = np.full(n_act, -1, np.int64)
        last_op[o_action] = np.arange(n_op)
        cp = np.nonzero(is_copy[code] & (last_op >= 0))[0]
        # a copy call that was still running when its copy started is a synchronous copy: it
        # returns when the (pageable) copy it paces has finished
        blocking = cp[(a_end[cp] + SYNC_CLOCK_TOL_NS >= o_end[last_op[cp]]) | (o_ts[last_op[cp]] < a_end[cp])]
        a_wait[blocking] = last_op[blocking]
    a_kind[(a_wait >= 0) & (a_kind != LAUNCH)] = SYNC

    # cross-stream waits: after cudaStreamWaitEvent, the next op waits for the other streams'
    # work issued before the call (kept only where the recorded start agrees)
    o_deps: dict = {}
    if n_op:
        wev = np.nonzero(np.array([s.startswith(("cudaStreamWaitEvent", "cuStreamWaitEvent")) for s in labels] + [False])[code])[0]
        # each stream's ops in issue order (o_action is sorted): the ops issued before a wait
        # on a stream are a prefix of its list
        stream_ops = [(s, np.nonzero(o_stream == s)[0]) for s in np.unique(o_stream).tolist()]
        for i in wev:
            j = np.searchsorted(o_action, i, side="right")
            if j >= n_op:
                continue
            issued = np.searchsorted(o_action, i, side="left")  # the ops of the calls before the wait
            deps = []
            for s, on in stream_ops:
                if s == o_stream[j]:
                    continue
                # the event was recorded after some op of that stream: the latest one issued
                # before the wait that had ended when this op started (an event recorded after
                # an earlier op, with later work already queued behind it, is the common case:
                # DDP copies bucket 1 back while bucket 2's all-reduce runs)
                on_s = on[:np.searchsorted(on, issued)]
                done = on_s[o_end[on_s] <= o_ts[j] + SYNC_CLOCK_TOL_NS]
                if len(done):
                    deps.append(int(done[-1]))
            if deps:
                have = o_deps.setdefault(int(j), [])
                have.extend(d for d in deps if d not in have)

        for j, deps in _graph_order(o_action, o_stream, o_ts, o_end, is_graph[code]).items():
            have = o_deps.setdefault(j, [])
            have.extend(d for d in deps if d not in have)

    # launch latency and unexplained delays, from the recorded starts. The first op of each
    # stream may have queued behind work launched before the window: no delay is kept for it
    # (the replay starts from an idle GPU, as a steady loop's step does on average).
    prev_end = np.full(n_op, np.iinfo(np.int64).min // 2, np.int64)
    first = np.zeros(n_op, dtype=bool)
    for s in np.unique(o_stream):
        idx = np.nonzero(o_stream == s)[0]
        prev_end[idx[1:]] = o_end[idx[:-1]]
        first[idx[0]] = True
    launch_ts = a_ts[o_action] if n_op else np.zeros(0, np.int64)
    free = (prev_end < launch_ts) & (o_ts >= launch_ts) & ~first
    lat = float(np.percentile(o_ts[free] - launch_ts[free], LATENCY_PERCENTILE)) if free.sum() >= MIN_LATENCY_SAMPLES \
        else DEFAULT_LAUNCH_LATENCY_NS
    ready = np.maximum(prev_end, launch_ts + lat)
    for j, deps in o_deps.items():
        ready[j] = max(ready[j], max(o_end[d] for d in deps))
    for j, d in _implicit_waits(o_ts, o_end, o_stream, ready, first).items():
        o_deps.setdefault(j, []).append(d)
        ready[j] = max(ready[j], o_end[d])
    o_delay = np.where(first, 0, np.maximum(o_ts - ready, 0)).astype(np.float64)

    # host time: gaps between actions (merged lane) and each call's own cost, then deflation
    cursor = np.maximum.accumulate(a_end)
    prev_cursor = np.concatenate([[lo], cursor[:-1]])
    gap_raw = (a_ts - prev_cursor).astype(np.float64)
    wait_raw = np.zeros(n_act)
    w = a_wait >= 0
    if w.any():
        wait_raw[w] = np.clip(o_end[a_wait[w]] - a_ts[w], 0, a_end[w] - a_ts[w])
    wait_raw += queue_wait_ns(a_ts, a_end, a_kind, a_wait, a_code, o_action, o_ts)
    blocking = np.nonzero((is_sync[code] | is_dev[code]) & (a_row >= 0) & (a_wait < 0))[0]
    wait_raw[blocking] = _backlog_wait_ns(rt, a_ts[blocking], a_end[blocking])
    cost_raw = (a_end - a_ts).astype(np.float64) - wait_raw
    ops_ts, py_ts, bi_ts, shapes = _host_event_starts(rt, lo, hi)

    def per_gap(ts: np.ndarray) -> np.ndarray:  # events by the gap they started in (gap i ends at action i)
        return np.bincount(np.searchsorted(a_ts, ts, side="left"), minlength=n_act + 1)[:n_act]

    over = (per_gap(ops_ts) * (profiler.op_shapes_ns if shapes else profiler.op_ns)
            + per_gap(py_ts) * profiler.python_ns + per_gap(bi_ts) * profiler.builtin_ns)
    gap_raw[a_kind == COLL_END] = 0.0  # the time before a collective's end is waiting for it
    rt_over = np.where(a_row >= 0, profiler.runtime_ns, 0.0)
    o_coll = np.full(n_op, -1, np.int64)
    if colls is not None and not colls.host and len(colls.ids) and n_op:
        # GPU collectives: the kernel that starts when the collective does
        by_ts = np.argsort(o_ts, kind="stable")
        pos_ = np.searchsorted(o_ts[by_ts], colls.start)
        for k, p_ in enumerate(pos_):
            for q in (p_, p_ - 1):
                if 0 <= q < n_op and abs(int(o_ts[by_ts[q]]) - int(colls.start[k])) <= SYNC_CLOCK_TOL_NS // 5:
                    o_coll[by_ts[q]] = colls.ids[k]
                    break
    graph = Graph(rank=rt.rank, lo=lo, hi=hi, step_number=steps.number.copy(), a_ts=a_ts, a_end=a_end, a_kind=a_kind,
                 a_row=a_row, a_wait=a_wait, a_name=labels, a_code=a_code, gap=gap_raw.copy(), cost=cost_raw.copy(),
                 gap_raw=gap_raw, cost_raw=cost_raw, over=over, rt_over=rt_over, o_action=o_action, o_stream=o_stream, o_dur=o_dur, o_ts=o_ts, o_end=o_end,
                 o_delay=o_delay, o_table=o_table, o_row=o_row, o_deps=o_deps, launch_latency_ns=lat,
                 profiler=profiler, a_coll=a_coll, o_coll=o_coll,
                 c_others=dict(colls.others) if colls is not None else {},
                 c_transfer=dict(colls.transfer) if colls is not None else {})
    graph.deflate(1.0)
    return graph
