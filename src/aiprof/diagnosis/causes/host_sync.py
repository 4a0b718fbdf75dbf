"""HOST_SYNC: reading GPU values on the host (``.item()``, ``.cpu()``, ``.tolist()``, ``print``)
or an explicit ``torch.cuda.synchronize()`` inside the step.

Mechanism: a read of a GPU value blocks the host until every kernel queued before it has run;
the GPU then has nothing queued until the host launches again. One read per step at the end
costs little; one per parameter tensor (per-tensor logging), or a read followed by host work,
drains the queue over and over.

Evidence: blocking calls grouped by the user's line that made them, with their count per step.
Fix priced: per-tensor reads become one (the values stacked on the GPU, copied once); a read
per step no longer blocks (kept on the GPU, or copied asynchronously and read later).

Place: a per-tensor group owns its loop, the host work from the first read of a step to the last
(the ops that compute each value between the reads). While the reads are in it no CUDA graph can
capture that loop (a capture may not synchronize), so the generic launch remedy leaves it here:
batching the values is the change that makes it fast, and its remedy names that change.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.analysis.runtime import is_scalar_read
from aiprof.diagnosis.causes.common import idle_claim, ms, owned_actions, site_and_stack
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "HOST_SYNC"
# At least this many reads per step from one line is the per-tensor pattern (one per parameter
# or per layer), whose fix is to stack the values and copy once.
PER_TENSOR_MIN = 8
# Syncs made by the profiler itself, or by aiprof, are not the job's.
_OWN_FRAMES = ("torch/profiler/", "torch/autograd/profiler", "aiprof/")


def _read_span(f: RankFacts, node: int) -> tuple[int, int] | None:
    """Start and end of the outermost read op (``aten::item`` around ``_local_scalar_dense``)
    holding the host node, or None outside one."""
    span = None
    for n in f.tree.ancestors(node):
        if f.tree.kind[n] == OP:
            if not is_scalar_read(f.tree.name(n)):
                break
            span = (int(f.tree.start[n]), int(f.tree.end[n]))
    return span


def _read_loop(f: RankFacts, read_nodes: np.ndarray) -> np.ndarray:
    """Node mask: the host work of a per-tensor group's loop in each step, on the thread that
    reads. It spans from one read interval before the step's first read (the ops computing the
    first value) to the end of its last read; a read interval is the median time between
    consecutive reads of the group in a step."""
    tree = f.tree
    out = np.zeros(len(tree), dtype=bool)
    if not len(read_nodes):
        return out
    starts, ends = tree.start[read_nodes], tree.end[read_nodes]
    step = f.steps.index_of(starts)
    tid = tree.tid[read_nodes[0]]
    for s in np.unique(step):
        on = np.sort(starts[step == s])
        if len(on) < 2:
            continue
        interval = float(np.median(np.diff(on)))
        lo, hi = on[0] - interval, ends[step == s].max()
        out |= (tree.tid == tid) & (tree.start >= lo) & (tree.end <= hi)
    return out


def _remove_read_host_time(f: RankFacts, drop: np.ndarray, e) -> None:
    """The fix removes the reads themselves, not only their waits: the host time inside each
    dropped read op (its dispatch, the copy and sync calls, the conversion to a Python number)
    goes too; in a host-bound loop that is most of what a read costs."""
    g = f.graph
    nodes = f.action_nodes()
    prev_end = np.concatenate([[g.lo], np.maximum.accumulate(g.a_end)[:-1]])
    for a in drop.tolist():
        span = _read_span(f, int(nodes[a])) if nodes[a] >= 0 else None
        if span is None:
            continue
        s, t = span
        lo_i, hi_i = np.searchsorted(g.a_ts, s), np.searchsorted(g.a_ts, t, side="right")
        inside = np.arange(lo_i, hi_i)
        inside = inside[g.a_row[inside] >= 0]
        # calls made inside the read, and the host time before each that the read spent
        frac = np.clip((g.a_ts[inside] - np.maximum(prev_end[inside], s)) / np.maximum(g.gap_raw[inside], 1), 0, 1)
        e.gap_remove[inside] += np.maximum(g.gap[inside], 0) * frac
        e.cost_remove[inside] = g.cost[inside]
        if hi_i < g.n_actions:  # the read's tail (the Python number) before the next call
            tail = np.clip((t - prev_end[hi_i]) / max(g.gap_raw[hi_i], 1), 0, 1)
            e.gap_remove[hi_i] += max(g.gap[hi_i], 0) * tail


def detect(f: RankFacts) -> list[Cause]:
    g = f.graph
    # a wait inside a region an earlier cause owns (a checkpoint's copies) is that cause's
    waits = np.nonzero((g.a_wait >= 0) & (g.a_row >= 0) & ~owned_actions(f))[0]
    if not len(waits):
        return []
    nodes = f.action_nodes()[waits]
    ok = nodes >= 0
    waits, nodes = waits[ok], nodes[ok]
    ops = f.tree.nearest(nodes, OP)
    # ops that copy host memory to the GPU: their syncs are PAGEABLE_COPY's (a write, not a read)
    h2d_ops = set()
    m = f.rt.memops
    if g.n_ops and len(m):
        names = m.strings("name")
        h2d = np.array(["HtoD" in s for s in names.labels] + [False])
        mem = np.nonzero(g.o_table == 1)[0]
        hit = mem[h2d[names.codes[g.o_row[mem]]]]
        an = f.action_nodes()[g.o_action[hit]]
        h2d_ops = set(f.tree.nearest(an[an >= 0], OP).tolist()) - {-1}
    groups: dict[tuple[str, str], list[int]] = {}
    read_ops: dict[tuple[str, str], set[int]] = {}  # the read ops of each group (a read may wait twice)
    stacks: dict[tuple[str, str], int] = {}
    explicit_keys: set[tuple[str, str]] = set()  # a synchronize the script calls, not a read
    for k, (a, n, o) in enumerate(zip(waits, nodes, ops)):
        if int(o) in h2d_ops:
            continue
        stack = f.tree.stack(int(n))
        if any(s.startswith(_OWN_FRAMES) for s in stack):
            continue
        call = g.action_name(int(a))
        op = f.tree.labels[f.tree.code[o]] if o >= 0 else ""
        # syncs outside a read of a GPU value and outside torch.cuda.synchronize are not this
        # mechanism (cudaFree, cuDNN's search, a pageable copy: other detectors own them)
        explicit = any("synchronize" in s for s in stack[-3:]) or (not op and "Synchronize" in call and not stack)
        if not (op and is_scalar_read(op)) and not explicit:
            continue
        site = f.tree.user_site(int(n))
        # a backend thread's own copies (gloo staging a tensor, NCCL's watchdog) are not the
        # job's reads: only the training thread's, or one a user frame made
        if not site and f.tree.tid[n] != f.tree.main_tid:
            continue
        key = (site, op or call)
        groups.setdefault(key, []).append(int(a))
        read_ops.setdefault(key, set()).add(int(o) if o >= 0 else -1 - int(a))
        stacks.setdefault(key, int(n))
        if explicit and not (op and is_scalar_read(op)):
            explicit_keys.add(key)
    out = []
    per = max(len(f.steps), 1)
    for (site, what), acts in groups.items():
        acts_a = np.array(acts)
        calls_per_step = len(read_ops[(site, what)]) / per
        e = f.edit(CODE)
        if calls_per_step >= PER_TENSOR_MIN:
            # one copy per step remains: keep the last read of each step
            st = f.steps.index_of(g.a_ts[acts_a])
            last = np.array([acts_a[st == s][-1] for s in np.unique(st)])
            drop = np.setdiff1d(acts_a, last)
            e.no_wait[drop] = True
            e.cost_remove[drop] = g.cost[drop]
            e.drop_op[np.isin(g.o_action, drop)] = True
            _remove_read_host_time(f, drop, e)
            pattern = "per-tensor"
            remedy = (f"Keep the values on the GPU and copy them once per step: collect them with torch.stack(...) "
                      f"(or torch._foreach_norm for norms) and call .cpu()/.tolist() once, instead of "
                      f"{calls_per_step:.0f} separate reads at {site or 'this line'}; or log them every N steps.")
        elif (site, what) in explicit_keys:
            e.no_wait[acts_a] = True
            pattern = "per-step"
            remedy = (f"The script synchronizes with the GPU {calls_per_step:.0f}x per step "
                      f"({'at ' + site if site else 'no Python stack recorded: `aiprof run --what python` names the line'}): "
                      "remove the torch.cuda.synchronize() from the step, or call it every N steps; to time a step, "
                      "record torch.cuda.Event(enable_timing=True) pairs and read them a step later.")
        else:
            e.no_wait[acts_a] = True
            pattern = "per-step"
            remedy = (f"Do not block on the GPU at {site or 'this line'} every step: keep the value on the GPU and "
                      "read it every N steps, or copy it with .to('cpu', non_blocking=True) into pinned memory and "
                      "read it after a CUDA event, once the step's work is queued.")
        node = stacks[(site, what)]
        _, stack = site_and_stack(f, node)
        region = f.under(np.isin(np.arange(len(f.tree)), f.action_nodes()[acts_a]))
        op_nodes = f.tree.nearest(f.action_nodes()[acts_a], OP)
        if (op_nodes >= 0).any():
            region |= f.under(np.isin(np.arange(len(f.tree)), op_nodes[op_nodes >= 0]))
        if pattern == "per-tensor":
            region |= f.under(_read_loop(f, np.unique(np.where(op_nodes >= 0, op_nodes, f.action_nodes()[acts_a]))))
        wait_ns = float(np.clip(g.o_end[g.a_wait[acts_a]] - g.a_ts[acts_a], 0, None).sum())
        label = what.replace("aten::_local_scalar_dense", ".item()").replace("aten::item", ".item()")
        explicit = (site, what) in explicit_keys
        if explicit:
            # a device sync outside any op is the script's own torch.cuda.synchronize() (torch's ops
            # synchronize inside an op: .item(), .cpu(), a pageable copy)
            label = "torch.cuda.synchronize()"
            what_where = (f"{label} per step at {site}" if site else
                          f"{label} per step ({what} outside any op: the script's own synchronize; no Python "
                          "stack recorded)")
        else:
            # a read without a Python stack: the op that makes it is what the trace knows
            what_where = (f"blocking {label} per step at "
                          + (site or f"{what} (no Python stack recorded: `aiprof run --what python` names the line)"))
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"{calls_per_step:.0f} {what_where} wait for the GPU "
                   f"({ms(wait_ns / per)} of host waiting per step)"),
            mechanism=(("A synchronize" if explicit else "Each read of a GPU value")
                       + " blocks the host until the GPU has run everything queued before it; the GPU then has "
                       "nothing to do until the host queues more work."),
            remedy=remedy, place=Place("python" if site else "op", label, site, stack),
            evidence={"call": g.action_name(int(acts_a[0])), "op": what, "site": site, "calls": len(acts_a),
                      "calls_per_step": calls_per_step, "host_wait_us": wait_ns / 1e3, "pattern": pattern,
                      "explicit_synchronize": explicit},
            edit=e, region=region, claims=idle_claim(f, region)))
    return out


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect,
                    acts_on=("host: cuda sync",))
