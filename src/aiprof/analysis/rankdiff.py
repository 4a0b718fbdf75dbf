"""What differs between two ranks' work beyond time: a straggler's inputs, collectives and speed
compared with the base (median) rank's (analysis/ranks.diff_evidence; docs/findings.md, STRAGGLER).

* **Input shapes** (traces with ``record_shapes``): the ops of the straggler's median step and of
  the same step on the base rank, by name. Calls whose input shapes occur as often on both
  ranks match whatever their order; the calls left over are paired in order, and a pair whose shapes differ is the same op given other
  inputs. Only the outermost such call counts (an ``aten::linear`` on longer sequences holds
  an ``aten::mm`` on longer sequences); each carries the time difference of the pair: the GPU
  time of the kernels it launched when the ranks have kernels, else its host time.
* **Collectives**: calls and sizes per collective type and step, where the host issued them
  (bytes where the trace records the dtype, else elements).
* **Speed of the same work**: kernels (or, on a CPU-only job, the ops' own time) grouped by
  what they ran on (the kernel, its op and the op's input shapes, the outermost op and its
  shapes) and found on both ranks: the
  straggler's time against the same calls at the base rank's time per call. Slower on the same
  inputs is a slower device (or a loaded host), not more work. Needs the shapes.
* **GPU clocks**: the median SM clock of each rank's GPU over the analysed window (``hw.csv``).

Everything returned is a plain JSON-able dict, so it travels from a worker unchanged.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np

from aiprof.analysis.comm import DTYPE_BYTES
from aiprof.analysis.hotspots import OP, HostTree, host_tree
from aiprof.analysis.launch import launch_rows
from aiprof.analysis.steps import Steps, find_steps
from aiprof.trace import classify
from aiprof.trace.store import RankTrace

NS_PER_US = 1000.0
# Items kept for reading: the few largest differences say what differs; more is noise to a reader.
TOP = 5
# (op, the straggler's input dims) pairs kept so the straggler's cause can price bringing them to
# the base rank's time: a model's forward and backward hold a few dozen; past this many the rest
# carry little time each, and the evidence stays a few kB.
EDIT_MAX = 64
# The same work on the same inputs counts only where both ranks ran it: a signature each rank ran
# at least this many times in the analysed window (one call's time is too noisy to compare).
SPEED_MIN_CALLS = 2
# Ops whose time is waiting (for other ranks, for the device) rather than their own work.
_WAITING_OPS = ("c10d::", "gloo:", "nccl:", "record_param_comms", "aten::_local_scalar_dense", "aten::item")
# The ranks' calls or sizes per step of a collective type differ when they are this far apart
# (the same buckets are the same size on every rank: any difference is real; this leaves room
# for rounding).
COLL_SIZE_TOL = 0.01


def parse_dims(text: str) -> list:
    """A recorded ``input_dims`` string as lists (``[]`` where it is empty or unreadable)."""
    try:
        v = json.loads(text) if text else []
    except ValueError:
        return []
    return v if isinstance(v, list) else []


def numel(arg) -> int:
    """Elements of one recorded argument: a tensor's dims, or a list of tensors' dims (a
    TensorList); 0 for a non-tensor argument (recorded as ``[]``)."""
    if not isinstance(arg, list) or not arg:
        return 0
    if all(isinstance(x, int) for x in arg):
        return int(np.prod(arg, dtype=np.float64))
    return sum(numel(x) for x in arg)


def shape_change(base_dims: str, rank_dims: str) -> dict:
    """The arguments whose shapes differ between two calls: each side's shapes as text, the size
    ratio of those arguments (rank over base; None when the base's are empty) and, when one
    argument differs in one dimension only, that dimension and its two sizes."""
    b, r = parse_dims(base_dims), parse_dims(rank_dims)
    n = max(len(b), len(r))
    b += [[]] * (n - len(b))
    r += [[]] * (n - len(r))
    idx = [i for i in range(n) if b[i] != r[i]]
    nb = sum(numel(b[i]) for i in idx)
    nr = sum(numel(r[i]) for i in idx)
    out = {"base_shape": ", ".join(json.dumps(b[i]) for i in idx), "rank_shape": ", ".join(json.dumps(r[i]) for i in idx),
           "ratio": nr / nb if nb else None, "arg": None, "dim": None, "base_size": None, "rank_size": None}
    if len(idx) == 1:
        i = idx[0]
        if (isinstance(b[i], list) and isinstance(r[i], list) and len(b[i]) == len(r[i])
                and all(isinstance(x, int) for x in b[i] + r[i])):
            dd = [k for k in range(len(b[i])) if b[i][k] != r[i][k]]
            if len(dd) == 1:
                out.update(arg=i, dim=dd[0], base_size=b[i][dd[0]], rank_size=r[i][dd[0]])
    return out


def median_step(steps: Steps) -> int:
    """Index of the step closest to the median duration (as analysis.diff picks it)."""
    d = steps.end - steps.start
    return int(np.argmin(np.abs(d - np.median(d))))


def shapes_recorded(rt: RankTrace) -> bool:
    """Whether the trace has ops' input shapes (``record_shapes``)."""
    o = rt.ops
    return bool(len(o)) and "input_dims" in o and any(s not in ("", "[]") for s in o.strings("input_dims").labels)


# --------------------------------------------------------------------------------- tree helpers
def _by_depth(tree: HostTree) -> list[np.ndarray]:
    """Node indices of each depth >= 1, shallowest first (a node's parent is one level up)."""
    if not len(tree):
        return []
    order = np.argsort(tree.depth, kind="stable")
    d = tree.depth[order]
    cuts = np.searchsorted(d, np.arange(1, int(d.max()) + 2))
    return [order[cuts[k]:cuts[k + 1]] for k in range(len(cuts) - 1) if cuts[k + 1] > cuts[k]]


def _below_marked(tree: HostTree, marked: np.ndarray) -> np.ndarray:
    """Nodes with a marked strict ancestor."""
    out = np.zeros(len(tree), dtype=bool)
    for idx in _by_depth(tree):
        p = tree.parent[idx]
        out[idx] = out[p] | marked[p]
    return out


def _owner(tree: HostTree, marked: np.ndarray) -> np.ndarray:
    """Each node's nearest marked ancestor-or-self (-1: none)."""
    own = np.where(marked, np.arange(len(tree)), -1)
    for idx in _by_depth(tree):
        p = tree.parent[idx]
        own[idx] = np.where(marked[idx], idx, own[p])
    return own


def _launch_nodes(rt: RankTrace, tree: HostTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every kernel and copy that is not communication: the tree node of its launch call (-1:
    unknown), its GPU ns, and its name (kernel name or copy kind)."""
    nodes, dur, names = [], [], []
    for tname in ("kernels", "memops"):
        g = rt.table(tname)
        if not len(g):
            continue
        keep = np.ones(len(g), dtype=bool)
        if "cls" in g:
            keep = ~g.strings("cls").isin_labels(lambda s: s == classify.COMMUNICATION)
        lr = launch_rows(rt.runtime, g) if len(rt.runtime) else np.full(len(g), -1, np.int64)
        node = np.full(len(g), -1, np.int64)
        ok = lr >= 0
        if len(tree.runtime_node):
            node[ok] = tree.runtime_node[lr[ok]]
        s = g.strings("name")
        nodes.append(node[keep])
        dur.append(g["dur"][keep].astype(np.float64))
        names.append(np.array(s.labels + [""], dtype=object)[s.codes[keep]])
    if not nodes:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0, object)
    return np.concatenate(nodes), np.concatenate(dur), np.concatenate(names)


def _gpu_under(tree: HostTree, marked: np.ndarray, launch: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """GPU ns of the kernels and copies launched under each marked node (per tree node)."""
    out = np.zeros(len(tree))
    ok = launch >= 0
    if not ok.any():
        return out
    own = _owner(tree, marked)[launch[ok]]
    m = own >= 0
    np.add.at(out, own[m], dur[ok][m])
    return out


# ---------------------------------------------------------------------------------------- shapes
def _step_ops(rt: RankTrace, tree: HostTree, steps: Steps, i: int) -> dict[str, list[tuple[int, str]]]:
    """The ops of step ``i`` by name: (tree node, input dims), in start order."""
    lo, hi = int(steps.start[i]), int(steps.end[i])
    m = (tree.kind == OP) & (tree.start >= lo) & (tree.start < hi)
    nodes = np.nonzero(m)[0]
    nodes = nodes[np.argsort(tree.start[nodes], kind="stable")]
    dims = rt.ops.strings("input_dims")
    dl = dims.labels
    dc = dims.codes[tree.row[nodes]]
    out: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for n, c in zip(nodes.tolist(), dc.tolist()):
        out[tree.labels[tree.code[n]]].append((n, dl[c]))
    return out


def _left_over(calls: list[tuple[int, str]], common: Counter) -> list[tuple[int, str]]:
    """The calls not matched by a call with the same shapes on the other rank (the first ones
    of each shape are the matched ones)."""
    budget = Counter(common)
    out = []
    for n, d in calls:
        if budget[d] > 0:
            budget[d] -= 1
        else:
            out.append((n, d))
    return out


def compare_shapes(base: RankTrace, slow: RankTrace) -> dict:
    """The ops of the straggler's median step whose input shapes differ from the same op's in
    the same step of the base rank (see the module docstring). ``ops``: the TOP largest
    differences, each with both ranks' input dims, the arguments that differ and their size
    ratio, calls, time on each rank and their difference per step (``time`` says GPU or host);
    ``first``: the first op the program itself calls on other shapes; ``delta_us`` and
    ``larger_delta_us``: the differences summed (over all ops, over those on larger inputs);
    ``unpaired_ops``: ops called a different number of times; ``edit``: ``[op, the straggler's
    input dims, host µs more per step, host µs per step, the base rank's GPU time over the
    straggler's (None without kernels)]`` of the EDIT_MAX largest, for pricing."""
    out = {"recorded": shapes_recorded(base) and shapes_recorded(slow), "steps": None, "ops": [], "first": None,
           "delta_us": 0.0, "larger_delta_us": 0.0, "groups": 0, "unpaired_ops": [], "time": "", "edit": []}
    if not out["recorded"]:
        return out
    sb, ss = find_steps(base), find_steps(slow)
    if not len(sb) or not len(ss):
        return out
    tb, ts = host_tree(base), host_tree(slow)
    # the straggler's median step against the same iteration on the base rank (the ranks meet
    # at its collectives: a job whose lengths vary by step compares the inputs they met with)
    i_s = median_step(ss)
    same = np.nonzero(sb.number == ss.number[i_s])[0]
    i_b = int(same[0]) if len(same) else median_step(sb)
    out["steps"] = {"rank": int(ss.number[i_s]), "base": int(sb.number[i_b])}
    ob = _step_ops(base, tb, sb, i_b)
    os_ = _step_ops(slow, ts, ss, i_s)
    pairs: list[tuple[int, str, int, str]] = []  # (base node, base dims, slow node, slow dims)
    unpaired = []
    for name in sorted(ob.keys() & os_.keys()):
        bl, sl = ob[name], os_[name]
        cb, cs = Counter(d for _, d in bl), Counter(d for _, d in sl)
        if cb == cs:
            continue
        common = cb & cs
        lb, ls = _left_over(bl, common), _left_over(sl, common)
        if len(lb) != len(ls):
            unpaired.append({"op": name, "base_calls": len(bl), "rank_calls": len(sl)})
            continue  # not the same calls on other inputs: more or fewer calls (the diff's items)
        pairs += [(nb, db, ns, ds) for (nb, db), (ns, ds) in zip(lb, ls)]
    unpaired.sort(key=lambda u: (-abs(u["rank_calls"] - u["base_calls"]), u["op"]))
    out["unpaired_ops"] = unpaired[:TOP]
    if not pairs:
        return out
    diff_s = np.zeros(len(ts), dtype=bool)
    diff_s[[p[2] for p in pairs]] = True
    outer_s = diff_s & ~_below_marked(ts, diff_s)
    keep = [p for p in pairs if outer_s[p[2]]]
    outer_b = np.zeros(len(tb), dtype=bool)
    outer_b[[p[0] for p in keep]] = True
    gpu = bool(len(slow.kernels) and len(base.kernels))
    if gpu:
        lb_, db_, _ = _launch_nodes(base, tb)
        ls_, ds_, _ = _launch_nodes(slow, ts)
        gb, gs = _gpu_under(tb, outer_b, lb_, db_), _gpu_under(ts, outer_s, ls_, ds_)
    out["time"] = "gpu" if gpu else "host"
    # called by the program itself, not inside another op
    ks = np.array([p[2] for p in keep], dtype=np.int64)
    par = ts.parent[ks]
    top_level = np.ones(len(ks), dtype=bool)
    top_level[par >= 0] = ts.nearest(par[par >= 0], OP) < 0
    groups: dict[tuple[str, str, str], dict] = {}
    for (nb, db, ns, ds), top in zip(keep, top_level.tolist()):
        name = ts.labels[ts.code[ns]]
        g = groups.setdefault((name, db, ds), {"calls": 0, "rank_host_us": 0.0, "base_host_us": 0.0,
                                               "rank_gpu_us": 0.0, "base_gpu_us": 0.0, "first_ns": int(ts.start[ns]),
                                               "top_level": False})
        g["calls"] += 1
        g["rank_host_us"] += float(ts.end[ns] - ts.start[ns]) / NS_PER_US
        g["base_host_us"] += float(tb.end[nb] - tb.start[nb]) / NS_PER_US
        if gpu:
            g["rank_gpu_us"] += float(gs[ns]) / NS_PER_US
            g["base_gpu_us"] += float(gb[nb]) / NS_PER_US
        g["first_ns"] = min(g["first_ns"], int(ts.start[ns]))
        g["top_level"] |= top
    items = []
    for (name, db, ds), g in groups.items():
        ch = shape_change(db, ds)
        host_d = g["rank_host_us"] - g["base_host_us"]
        gpu_d = g["rank_gpu_us"] - g["base_gpu_us"]
        items.append({"op": name, "base_dims": db, "rank_dims": ds, **ch, "calls": g["calls"],
                      "rank_us": g["rank_gpu_us"] if gpu else g["rank_host_us"],
                      "base_us": g["base_gpu_us"] if gpu else g["base_host_us"],
                      "delta_us": gpu_d if gpu else host_d, "host_delta_us": host_d,
                      "rank_host_us": g["rank_host_us"], "_first": g["first_ns"], "_top": g["top_level"]})
    items.sort(key=lambda x: (-x["delta_us"], x["op"], x["rank_dims"]))
    out["groups"] = len(items)
    out["delta_us"] = float(sum(x["delta_us"] for x in items))
    out["larger_delta_us"] = float(sum(x["delta_us"] for x in items if (x["ratio"] or 0.0) > 1.0))
    # the input as it enters: the first op the program itself calls (not one inside another
    # op) whose shapes differ; else the first differing op
    top = [x for x in items if x["_top"]] or items
    first = min(top, key=lambda x: (x["_first"], x["op"]))
    clean = [{k: v for k, v in x.items() if not k.startswith("_")} for x in items]
    out["first"] = clean[items.index(first)]
    out["ops"] = clean[:TOP]
    # the GPU part: the base rank's kernel time over the straggler's, for the same op (None without kernels)
    out["edit"] = [[x["op"], x["rank_dims"], x["host_delta_us"], x["rank_host_us"],
                    (x["base_us"] / x["rank_us"]) if gpu and x["rank_us"] > 0 else None] for x in clean[:EDIT_MAX]]
    return out


# ----------------------------------------------------------------------------------- collectives
def collective_sizes(rt: RankTrace) -> dict:
    """Per collective type, calls and size per step over the analysed steps, counted where the
    host issued them (a GPU collective's kernel may start in the next step's window): bytes
    from the collectives' recorded arguments, else elements from the ``c10d::`` ops' shapes."""
    steps = find_steps(rt)
    if not len(steps):
        return {"unit": "", "by_type": {}}
    lo, hi, n = int(steps.start.min()), int(steps.end.max()), len(steps)
    c = rt.collectives
    by: dict[str, list] = defaultdict(lambda: [0, 0.0])
    unit = ""
    if len(c):
        sides = c.strings("side")
        for want in ("cpu", "gpu"):
            m = sides.isin_labels(lambda s, w=want: s == w) & (c["ts"] >= lo) & (c["ts"] < hi)
            if m.any():
                t = c.take(m)
                dt = t.strings("dtype")
                esize = np.array([DTYPE_BYTES.get(s, 0) for s in dt.labels] + [0], dtype=np.float64)[dt.codes]
                unit = "bytes" if (esize > 0).all() else "elements"
                size = np.maximum(t["in_nelems"], 0) * (esize if unit == "bytes" else 1.0)
                for k, s in zip(t["coll"], size):
                    by[str(k)][0] += 1
                    by[str(k)][1] += float(s)
                break
    if not unit and len(rt.ops):
        o = rt.ops
        names = o.strings("name")
        ctype = np.array([classify.collective_type(s) if s.startswith("c10d::") else "" for s in names.labels] + [""],
                         dtype=object)[names.codes]
        m = (ctype != "") & (o["ts"] >= lo) & (o["ts"] < hi)
        if m.any():
            unit = "elements"
            dims = o.strings("input_dims")
            for k, dc in zip(ctype[m], dims.codes[m]):
                args = parse_dims(dims.labels[dc])
                by[str(k)][0] += 1
                by[str(k)][1] += float(numel(args[0]) if args else 0)
    return {"unit": unit, "by_type": {k: {"calls": v[0] / n, "size": v[1] / n} for k, v in sorted(by.items())}}


def compare_collectives(base: RankTrace, slow: RankTrace) -> dict:
    """Both ranks' collective calls and sizes per step, and the types in which they differ."""
    b, s = collective_sizes(base), collective_sizes(slow)
    bt, st = b["by_type"], s["by_type"]
    differ = []
    for k in sorted(bt.keys() | st.keys()):
        x, y = bt.get(k, {"calls": 0, "size": 0.0}), st.get(k, {"calls": 0, "size": 0.0})
        if abs(x["calls"] - y["calls"]) > COLL_SIZE_TOL * max(x["calls"], y["calls"]) or abs(y["size"] - x["size"]) > COLL_SIZE_TOL * max(x["size"], y["size"]):
            differ.append(k)
    unit = s["unit"] if s["unit"] == b["unit"] else (s["unit"] or b["unit"])
    return {"unit": unit, "rank": st, "base": bt, "differ": differ}


# ----------------------------------------------------------------------------------------- speed
def _outermost_op(tree: HostTree, nodes: np.ndarray) -> np.ndarray:
    """Each node's outermost op, itself or an ancestor (-1: under no op)."""
    out = tree.nearest(nodes, OP)
    active = out >= 0
    while active.any():
        idx = np.nonzero(active)[0]
        p = tree.parent[out[idx]]
        up = np.full(len(idx), -1, np.int64)
        up[p >= 0] = tree.nearest(p[p >= 0], OP)
        hit = up >= 0
        out[idx[hit]] = up[hit]
        active[idx] = hit
    return out


def _work(rt: RankTrace) -> tuple[str, dict[tuple[str, str, str, str], list], int]:
    """The rank's work by what it ran on, over the analysed window: ("gpu", {(kernel, its op,
    the op's input dims, the outermost op and its dims): [calls, ns]}) from kernels and copies
    with their launching op, else ("host", {(op, "", input dims, the outermost op...): ...}) from
    the ops' own time (op children's taken out) where they have tensor inputs; and the step
    count. The outermost op is in the key because an inner op's recorded shapes can stay the
    same when the input the program passed is larger (``aten::embedding``'s ids, not its
    ``aten::index_select``'s)."""
    steps = find_steps(rt)
    tree = host_tree(rt)
    if not len(steps) or not len(tree):
        return "", {}, 0
    lo, hi = int(steps.start.min()), int(steps.end.max())
    dims = rt.ops.strings("input_dims")
    dl = dims.labels + [""]

    def sig(n: int) -> tuple[str, str]:
        return tree.labels[tree.code[n]], dl[dims.codes[tree.row[n]]]

    out: dict[tuple[str, str, str, str], list] = defaultdict(lambda: [0, 0.0])
    if len(rt.kernels):
        launch, dur, names = _launch_nodes(rt, tree)
        ok = launch >= 0
        if ok.any():
            ts_all = tree.start[np.maximum(launch, 0)]
            ok &= (ts_all >= lo) & (ts_all < hi)
        op = np.full(len(launch), -1, np.int64)
        op[ok] = tree.nearest(launch[ok], OP)
        top = np.full(len(launch), -1, np.int64)
        top[op >= 0] = _outermost_op(tree, op[op >= 0])
        for k, o, t, d in zip(names[op >= 0], op[op >= 0], top[op >= 0], dur[op >= 0]):
            key = (str(k), *sig(o), " ".join(sig(t)) if t != o else "")
            out[key][0] += 1
            out[key][1] += float(d)
        return "gpu", out, len(steps)
    # every op's own time (its op children's taken out), so nested ops count once
    ops = np.nonzero(tree.kind == OP)[0]
    own = (tree.end - tree.start).astype(np.float64)
    child = ops[tree.parent[ops] >= 0]
    if len(child):
        anc = tree.nearest(tree.parent[child], OP)
        np.subtract.at(own, anc[anc >= 0], (tree.end - tree.start)[child[anc >= 0]])
    ops = ops[(tree.start[ops] >= lo) & (tree.start[ops] < hi)]
    top = _outermost_op(tree, ops)
    tensor = np.array([sum(numel(a) for a in parse_dims(t)) > 0 for t in dl], dtype=bool)
    for n, t in zip(ops.tolist(), top.tolist()):
        name, d = sig(n)
        if name.startswith(_WAITING_OPS) or not tensor[dims.codes[tree.row[n]]]:
            continue  # waiting, or sized by scalar arguments the trace does not record (aten::empty)
        key = (name, "", d, " ".join(sig(t)) if t != n else "")
        out[key][0] += 1
        out[key][1] += float(own[n])
    return "host", out, len(steps)


def compare_speed(base: RankTrace, slow: RankTrace) -> dict | None:
    """The same work on the same inputs (see the module docstring) timed on both ranks: the
    straggler's time per step and what it would take at the base rank's time per call, their
    ratio, and the signatures that lose most. None without input shapes on both ranks."""
    if not (shapes_recorded(base) and shapes_recorded(slow)):
        return None
    kb, wb, nb = _work(base)
    ks, ws, ns = _work(slow)
    if not kb or kb != ks or not nb or not ns:
        return None
    rank_ns = at_base_ns = 0.0
    items = []
    for key in sorted(ws.keys() & wb.keys()):
        (cs, ts_), (cb, tb_) = ws[key], wb[key]
        if cs < SPEED_MIN_CALLS or cb < SPEED_MIN_CALLS:
            continue
        base_per = tb_ / cb
        rank_ns += ts_
        at_base_ns += cs * base_per
        items.append({"name": key[0], "op": key[1], "dims": key[2], "outer": key[3], "calls_per_step": cs / ns,
                      "rank_per_call_us": ts_ / cs / NS_PER_US, "base_per_call_us": base_per / NS_PER_US,
                      "extra_us": (ts_ - cs * base_per) / ns / NS_PER_US})
    if not items or at_base_ns <= 0:
        return None
    items.sort(key=lambda x: (-x["extra_us"], x["name"], x["op"], x["dims"], x["outer"]))
    return {"device": ks, "signatures": len(items), "rank_us": rank_ns / ns / NS_PER_US,
            "at_base_us": at_base_ns / ns / NS_PER_US, "ratio": rank_ns / at_base_ns,
            "extra_us": (rank_ns - at_base_ns) / ns / NS_PER_US, "top": items[:3]}


# ---------------------------------------------------------------------------------------- clocks
def sm_clock_mhz(rt: RankTrace) -> float | None:
    """The median SM clock of the rank's GPU over its analysed window: from the PM counters'
    GPC clock (every 100 µs) where they sampled it inside the window, else from ``hw.csv``'s
    NVML samples (all of them when none fall inside it: NVML is not read while PM samples);
    None without either."""
    pm = _pm_clock_mhz(rt)
    if pm is not None:
        return pm
    h = rt.table("hw")
    if not len(h):
        return None
    m = h.strings("metric").isin_labels(lambda s: s == "sm_clock_mhz")
    if not m.any():
        return None
    steps = find_steps(rt)
    if len(steps):
        w = m & (h["ts"] >= int(steps.start.min())) & (h["ts"] <= int(steps.end.max()))
        m = w if w.any() else m
    v = h["value"][m]
    v = v[np.isfinite(v)]
    return float(np.median(v)) if len(v) else None


def _pm_clock_mhz(rt: RankTrace) -> float | None:
    """The median PM ``pm_gpc_clock_hz`` sample (MHz) inside the rank's steps; None without one."""
    p = rt.table("pm")
    if not len(p):
        return None
    m = p.strings("metric").isin_labels(lambda s: s == "pm_gpc_clock_hz")
    steps = find_steps(rt)
    if len(steps):
        m = m & (p["t0"] >= int(steps.start.min())) & (p["t1"] <= int(steps.end.max()))
    v = p["value"][m]
    v = v[np.isfinite(v) & (v > 0)]
    return float(np.median(v)) / 1e6 if len(v) else None


def compare(base: RankTrace, slow: RankTrace) -> dict:
    """Input shapes, collectives, speed of the same work and GPU clocks of the straggler
    (``slow``) against the base rank."""
    cb, cs = sm_clock_mhz(base), sm_clock_mhz(slow)
    return {"shapes": compare_shapes(base, slow), "collectives": compare_collectives(base, slow),
            "speed": compare_speed(base, slow),
            "clocks": {"sm_clock_mhz": {"rank": cs, "base": cb}} if cb is not None and cs is not None else None}
