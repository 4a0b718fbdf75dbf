"""SM_ARRAY_IDLE: kernels that keep most of the GPU's SMs idle while they run (an under-filled GPU).

Mechanism: a kernel whose grid has fewer thread blocks than the GPU has SMs (a per-sample or
per-head loop of small ops, a small batch, a reduction into few outputs) leaves the other SMs
with nothing to do: its duration is set by the busy few. Run back to back, such kernels keep the
GPU "busy" while most of it idles.

One mechanism, one cause, two kinds of evidence; a kernel is judged by one of them only, so the
same kernels never get two causes:

* **GPU counters** (PM sampling, on by default under --what hw, capture.md "pm.csv.gz"): a compute kernel family whose
  kernels fill most of the sample windows they appear in (coverage >= ``MIN_COVERAGE_PCT``, so
  the counters are the family's own) with ``sm__cycles_active`` below
  ``analysis.counters.IDLE_SM_PCT``. Where a family's counters are its own they decide for it,
  either way: they see SMs that really idle (a serial tail, blocks of uneven length) or that are
  really busy (another stream's kernels filling the SMs a small grid leaves free), which the
  launch configuration cannot.
* **Launch configuration** (every kernel trace; the rest of the kernels): a kernel whose grid
  holds at most ``MAX_GRID_FILL`` x the SM count in thread blocks (``numSms`` of the trace's
  ``deviceProperties``, else the device table) leaves most SMs without a block for its whole
  run. Grouped by place: the user's function when it issues the ops itself (its frames reach the
  op through C builtins and torch's functional wrappers only: a loop over samples or heads),
  else the op that launched them; kernels launched inside a host region an earlier cause owns
  (a for-loop optimizer) are that cause's.

Fix priced (both): the same SM-time spread over every SM, i.e. each kernel's duration times the
share of SMs it kept busy (SM active, or blocks / SMs), never below the trace's shortest kernel
(no launch runs faster on this GPU): a work-conserving upper bound on what more parallelism per
launch saves, replayed through the graph so only time on the critical path counts.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from aiprof.analysis.counters import IDLE_SM_PCT
from aiprof.analysis.hotspots import OP, PYTHON, is_library_frame
from aiprof.analysis.kernels import is_matmul_kernel, kernel_family
from aiprof.diagnosis.causes.common import ms, steps_with
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.graph import LAUNCH
from aiprof.diagnosis.replay import Edit
from aiprof.hardware import device
from aiprof.diagnosis.model import MIN_REPORTED_SHARE, SLOW_KERNELS, Cause, Claim, Place
from aiprof.trace.classify import COMPUTE

CODE = "SM_ARRAY_IDLE"
#: The family must fill at least this share of the sample windows it touches, else the counters
#: are a blend with its neighbours' and say little about it.
MIN_COVERAGE_PCT = 50.0
#: SM-active is never taken below this when pricing: a reading near zero is a kernel shorter
#: than the sampler can resolve, not a kernel that could run 100x faster.
MIN_ACTIVE_FOR_PRICING_PCT = 5.0
#: A kernel is under-filled when its grid has at most this share of the SM count in thread
#: blocks: most SMs then get no block for its whole run (the GPU busy but mostly idle); a grid
#: nearer the SM count is a library's tile choice whose idle SMs cost it less than 2x.
MAX_GRID_FILL = 0.5
#: At most this many places per rank are priced (one replay each): the places are taken by
#: their upper bound, so the rest save less than the ones kept.
MAX_GRID_PLACES = 3
#: The same under-filled kernel this many times from one call of the user's function is a loop
#: (or repeated code) whose launches could be one batched launch.
LOOP_MIN_REPEATS = 2
#: Python frames between the user's function and an op that keep it the user's own call: C
#: builtins and torch's thin functional wrappers (``F.softmax``, ``Tensor.__matmul__``).
_THIN_FRAMES = ("<built-in", "torch/nn/functional.py", "torch/functional.py", "torch/_tensor.py")


def sm_count(f: RankFacts) -> int:
    """SMs of the traced device: the trace's ``numSms``, else the device table's (0: unknown)."""
    n = f.rt.sm_count
    if n:
        return n
    dev = device(f.rt.device_name)
    return dev.sms if dev is not None else 0


def grid_fill(f: RankFacts) -> np.ndarray:
    """Per replay op: the thread blocks of its grid over the device's SMs (NaN for copies,
    communication kernels, and kernels without a recorded grid or SM count)."""
    g = f.graph
    out = np.full(g.n_ops, np.nan)
    k = f.rt.kernels
    sms = sm_count(f)
    if not sms or not len(k) or "grid_x" not in k:
        return out
    gx, gy, gz = (np.asarray(k[c], dtype=np.int64) for c in ("grid_x", "grid_y", "grid_z"))
    cls = k.strings("cls")
    compute = np.array([s == COMPUTE for s in cls.labels] + [False])[cls.codes]
    ok = (gx > 0) & (gy > 0) & (gz > 0) & compute
    fill = np.where(ok, (gx * gy * gz) / float(sms), np.nan)
    kern = g.o_table == 0
    out[kern] = fill[g.o_row[kern]]
    return out


def spread_durations(f: RankFacts, sel: np.ndarray, busy_share: np.ndarray | float) -> np.ndarray:
    """New durations of the ops in ``sel``: the same SM-time spread over every SM (duration x
    share of SMs busy), never below the trace's shortest kernel nor above the recorded one."""
    g = f.graph
    kd = g.o_dur[(g.o_table == 0) & (g.o_dur > 0)]
    floor = float(kd.min()) if len(kd) else 0.0
    d = g.o_dur[sel]
    return np.minimum(d, np.maximum(d * busy_share, floor))


def detect(f: RankFacts) -> list[Cause]:
    if not f.graph.n_ops or not len(f.rt.kernels):
        return []
    out, decided = _counter_causes(f)
    return out + grid_causes(f, decided)


# ------------------------------------------------------------------ evidence: GPU counters
def _families(f: RankFacts) -> np.ndarray:
    """Kernel family of every replay op ("" for copies)."""
    g = f.graph
    names = f.rt.kernels.strings("name")
    fam_of_label = np.array([kernel_family(s) for s in names.labels] + [""], dtype=object)
    out = np.full(g.n_ops, "", dtype=object)
    kern = g.o_table == 0
    out[kern] = fam_of_label[names.codes[g.o_row[kern]]]
    return out


def _counter_causes(f: RankFacts) -> tuple[list[Cause], set]:
    """Causes from the PM counters, and the families whose counters are their own (decided)."""
    cnt = f.counters
    if cnt is None or not cnt.families:
        return [], set()
    g = f.graph
    fams = _families(f)
    out, decided = [], set()
    per = max(len(f.steps), 1)
    for fam in cnt.families:
        sm = fam["counters"].get("pm_sm_active_pct")
        if sm is None or fam["coverage_pct"] < MIN_COVERAGE_PCT:
            continue
        decided.add(fam["family"])
        sel = fams == fam["family"]
        if sm >= IDLE_SM_PCT or not sel.any():
            continue
        share = max(sm, MIN_ACTIVE_FOR_PRICING_PCT) / 100.0
        e = f.edit(CODE)
        e.op_dur[sel] = spread_durations(f, sel, share)
        fam_ns = float(g.o_dur[sel].sum())
        out.append(Cause(
            code=CODE, rank=f.rank,
            title=(f"{ms(fam_ns / per)} per step in {fam['family'][:60]} kernels that keep {100 - sm:.0f}% of the SMs "
                   f"idle (SM active {sm:.0f}% while they run)"),
            mechanism=("These kernels launch too few thread blocks to occupy every SM, so their duration is set by the "
                       "busy few while the rest of the GPU waits; the GPU's PM counters show the SM array mostly idle "
                       "during them."),
            remedy=("Give the kernels more parallelism: a larger batch or sequence per launch, fusing small launches "
                    "(torch.compile), a split-K/stream-K GEMM or a different reduction layout for the op that launches "
                    "them; if they are small by nature, overlap them with other work on another CUDA stream."),
            place=Place("kernel", fam["family"], "", [], []),
            evidence={"source": "GPU counters", "sm_active_pct": sm, "coverage_pct": fam["coverage_pct"],
                      "kernels": fam["kernels"], "sampled_us": fam["sampled_us"], "bound": fam["bound"],
                      "tensor_active_pct": fam["counters"].get("pm_tensor_active_pct"),
                      "dram_pct_of_peak": fam.get("dram_pct_of_peak"), "speedup_assumed": 1 / share},
            edit=e, claims=[Claim(SLOW_KERNELS, f.rank, fam_ns / 1e3 * (1 - share))]))
    return out, decided


# ------------------------------------------------------------------ evidence: launch configuration
def underfilled(f: RankFacts, max_fill: float = MAX_GRID_FILL, skip_families: set | None = None) -> np.ndarray:
    """Replay ops judged by their launch configuration as under-filled: compute kernels with at
    most ``max_fill`` x SMs thread blocks, outside host regions an earlier cause owns and
    outside the kernel families the counters decided."""
    g = f.graph
    fill = grid_fill(f)
    sel = ~np.isnan(fill)
    sel[sel] = fill[sel] <= max_fill
    owned = f.extra.get("owned_nodes")
    if sel.any() and owned is not None and len(owned) == len(f.tree) and owned.any():
        sel &= ~f.actions_in(owned)[g.o_action]
    if sel.any() and skip_families:
        sel &= ~np.isin(_families(f), list(skip_families))
    return sel


def _user_frames(f: RankFacts) -> tuple[np.ndarray, np.ndarray]:
    """Per tree node: the nearest user frame at or above it (-1: none), and whether every Python
    frame between that frame and the node is a thin wrapper (the user's function issues the op
    itself). One vectorised pass per tree depth, cached."""
    if "_user_frames" not in f.extra:
        tree = f.tree
        py = tree.kind == PYTHON if len(tree) else np.zeros(0, dtype=bool)
        user = py & f.node_mask(lambda s: not is_library_frame(s), (PYTHON,))
        neutral = ~py | f.node_mask(lambda s: s.startswith(_THIN_FRAMES), (PYTHON,))
        frame = np.where(user, np.arange(len(tree)), -1)
        thin = user | neutral
        for idx in f._by_depth():
            p = tree.parent[idx]
            inherit = ~user[idx]
            frame[idx] = np.where(inherit, frame[p], idx)
            thin[idx] = np.where(inherit, thin[p] & neutral[idx], True)
        f.extra["_user_frames"] = (frame, thin & (frame >= 0))
    return f.extra["_user_frames"]


def _origins(f: RankFacts, ix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per replay op of ``ix``: the user frame above its launch (-1: none), whether the user's
    function issues it itself, and the innermost op that launched it (-1: none)."""
    nodes = f.action_nodes()[f.graph.o_action[ix]]
    ok = nodes >= 0
    frame, direct = np.full(len(ix), -1, np.int64), np.zeros(len(ix), dtype=bool)
    op = np.full(len(ix), -1, np.int64)
    if ok.any():
        uf, th = _user_frames(f)
        frame[ok], direct[ok] = uf[nodes[ok]], th[nodes[ok]]
        op[ok] = f.tree.nearest(nodes[ok], OP)
    return frame, direct, op


def grid_places(f: RankFacts, sel: np.ndarray) -> dict[tuple[str, str], np.ndarray]:
    """The under-filled ops ``sel`` grouped by place: ("python", user site) for ops the user's
    function issues itself, else ("op", launching op) (the kernel family when no op is known)."""
    idx = np.nonzero(sel)[0]
    frame, direct, op = _origins(f, idx)
    fams = _families(f)
    tree = f.tree
    keys = [("python", tree.name(int(u))) if d else ("op", tree.name(int(o)) if o >= 0 else fams[i])
            for i, u, d, o in zip(idx.tolist(), frame.tolist(), direct.tolist(), op.tolist())]
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, key in zip(idx.tolist(), keys):
        groups[key].append(i)
    return {k: np.array(v, dtype=np.int64) for k, v in groups.items()}


def grid_causes(f: RankFacts, skip_families: set | None = None, max_fill: float = MAX_GRID_FILL,
                min_share: float = MIN_REPORTED_SHARE, max_places: int = MAX_GRID_PLACES) -> list[Cause]:
    """Causes from the launch configuration: one per place whose under-filled kernels could save
    at least ``min_share`` of a step if spread over every SM (the upper bound: a smaller one can
    never be reported), the ``max_places`` largest."""
    g = f.graph
    sel = underfilled(f, max_fill, skip_families)
    if not sel.any():
        return []
    fill = grid_fill(f)
    new = np.full(g.n_ops, np.nan)
    new[sel] = spread_durations(f, sel, fill[sel])
    saved = np.where(sel, g.o_dur - np.nan_to_num(new), 0.0)
    per = max(len(f.steps), 1)
    floor_ns = min_share * f.step_ns * per  # the bound a place needs over the window
    places = sorted(((float(saved[ix].sum()), key, ix) for key, ix in grid_places(f, sel).items()),
                    key=lambda t: -t[0])
    return [_grid_cause(f, key, ix, fill, new, max_fill) for bound, key, ix in places[:max_places] if bound >= floor_ns]


def _batch_the_loop(f: RankFacts, e: Edit, calls: np.ndarray) -> None:
    """The loop's iterations batched into one call, as the remedy says: in each call of the
    user's function, the kernels of one name collapse into one kernel doing all their work
    (the under-filled ones at their spread-over-every-SM duration, already in ``e.op_dur``), and
    the host's launches of the others, with the Python and dispatch time before each, are gone:
    a batched op is dispatched and launched once."""
    g = f.graph
    names = f.rt.kernels.strings("name").codes
    for call in calls.tolist():
        root = np.zeros(len(f.tree), dtype=bool)
        root[call] = True
        acts = f.actions_in(f.under(root)) & (g.a_kind == LAUNCH)
        ops = np.nonzero(acts[g.o_action])[0]
        if len(ops) < 2:
            continue
        gap_in = f.gap_time_in(f.union_of_nodes(root))
        dur = np.where(np.isnan(e.op_dur[ops]), g.o_dur[ops], e.op_dur[ops])
        code = names[g.o_row[ops]]
        for c in np.unique(code):
            same = ops[code == c]
            keep, rest = same[0], same[1:]
            if not len(rest):
                continue
            e.op_dur[keep] = float(dur[code == c].sum())
            e.drop_op[rest] = True
            gone = np.setdiff1d(g.o_action[rest], g.o_action[keep])
            e.cost_remove[gone] = g.cost[gone]
            e.gap_remove[gone] += gap_in[gone]


def _grid_cause(f: RankFacts, key: tuple[str, str], ix: np.ndarray, fill: np.ndarray, new: np.ndarray,
                max_fill: float) -> Cause:
    g = f.graph
    sms = sm_count(f)
    per = max(len(f.steps), 1)
    names = f.rt.kernels.strings("name")
    code = names.codes[g.o_row[ix]]
    dur = g.o_dur[ix]
    blocks = np.rint(fill[ix] * sms).astype(np.int64)
    kern_ns, bound_ns = float(dur.sum()), float((dur - new[ix]).sum())
    wfill = float((dur * fill[ix]).sum() / kern_ns) if kern_ns > 0 else 0.0
    # the kernels by time, and the one this place spends most in
    by_name = sorted(((float(dur[code == c].sum()), int(c)) for c in np.unique(code)), reverse=True)
    top_c = by_name[0][1]
    top_name = names.labels[top_c]
    top_blocks = int(np.median(blocks[code == top_c]))
    kernels = [{"name": names.labels[c][:120], "count": int((code == c).sum()), "us": ns / 1e3,
                "blocks": int(np.median(blocks[code == c]))} for ns, c in by_name[:5]]
    # one call of the user's function issuing the same kernel again and again: a loop
    kind, where = key
    nodes = f.action_nodes()[g.o_action[ix]]
    frame, _, _ = _origins(f, ix)
    repeats, rep_blocks = 0, top_blocks
    if kind == "python":  # frame: the call of the user's function each launch came from
        pairs, counts = np.unique(np.stack([frame, code]), axis=1, return_counts=True)
        j = int(np.argmax(counts))
        repeats = int(counts[j])
        rep_blocks = int(np.median(blocks[(frame == pairs[0, j]) & (code == pairs[1, j])]))
        top_name = names.labels[int(pairs[1, j])] if repeats >= LOOP_MIN_REPEATS else top_name
    loop = repeats >= LOOP_MIN_REPEATS
    users = frame[frame >= 0]
    site = where if kind == "python" else (
        f.tree.labels[int(np.bincount(f.tree.code[users]).argmax())] if len(users) else "")
    rep_node = int(nodes[np.argmax(dur)])
    stack = f.tree.stack(rep_node)[-6:] if rep_node >= 0 else []
    kshort = kernel_family(top_name)[:60]
    if loop:
        remedy = (f"{where} issues {repeats} {kshort} kernels of {rep_blocks} blocks per call, one after another, on "
                  f"a GPU with {sms} SMs. If the iterations are independent, batch them into one call: stack the "
                  "operands and use one torch.bmm/torch.matmul (softmax, norms and elementwise ops take the stacked "
                  "tensor as is; torch._foreach_* ops take lists of tensors), one launch of about "
                  f"{repeats * rep_blocks} blocks; if they are not, run independent chains on separate CUDA streams "
                  "so their kernels share the SMs.")
    elif kind == "python":
        remedy = (f"{where} launches {kshort} with {top_blocks} thread blocks for {sms} SMs: give each call more "
                  "parallel work (a larger batch or sequence, or merge it with similar calls into one batched op), or "
                  "overlap it with independent work on another CUDA stream.")
    elif is_matmul_kernel(top_name):
        remedy = (f"{where} multiplies matrices too small to tile across {sms} SMs ({top_blocks} blocks): give it more "
                  "rows per call (a larger batch, or several such products merged into one batched matmul); "
                  "torch.compile(mode=\"max-autotune\") benchmarks other GEMM kernels for the shape.")
    else:
        remedy = (f"{where} launches {kshort} with {top_blocks} blocks for {sms} SMs: its grid follows the op's output "
                  "(a small tensor, or a reduction into few outputs), not its work. torch.compile generates its own "
                  "kernels for such ops and splits a reduction with few outputs over more blocks; where many such ops "
                  "are independent, batch them into one call or overlap them on another CUDA stream.")
    in_nodes = np.zeros(len(f.tree), dtype=bool)
    in_nodes[nodes[nodes >= 0]] = True
    e = f.edit(CODE)
    e.op_dur[ix] = new[ix]
    if loop:
        _batch_the_loop(f, e, np.unique(frame[frame >= 0]))
    return Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(kern_ns / per)} per step in {len(ix) / per:.0f} under-filled kernels launched by {where[:80]}: "
               f"{top_blocks} thread blocks for {sms} SMs leave {100 * (1 - min(wfill, 1.0)):.0f}% of the GPU idle "
               "while they run"),
        mechanism=("These kernels launch fewer thread blocks than the GPU has SMs, so most SMs have no work while they "
                   "run and their duration is set by the busy few: the GPU counts as busy but is mostly idle."),
        remedy=remedy,
        place=Place(kind, where, site, stack, steps_with(f, in_nodes)),
        evidence={"source": "launch configuration", "sms": sms, "kernels_per_step": len(ix) / per,
                  "kernel_us_per_step": kern_ns / per / 1e3, "idle_sm_bound_us_per_step": bound_ns / per / 1e3,
                  "sm_fill": wfill, "blocks_median": int(np.median(blocks)), "kernels": kernels,
                  "repeats_per_call": repeats, "batched_blocks": repeats * rep_blocks if loop else None,
                  "loop": loop, "max_grid_fill": max_fill},
        edit=e)


DETECTOR = Detector(CODE, Scope.RANK, reads=("counters", "extra", "graph", "rt", "steps", "tree"), detect=detect)
