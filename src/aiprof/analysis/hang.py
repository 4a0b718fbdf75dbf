"""Hang snapshots: group the workers of a job by their main thread's stack, name the outliers.

Input: one record per process, as :func:`aiprof.attach.stacks.dump_one` returns it, plus
``rank`` (and optionally ``host``, ``last_collectives``). Output (schema in docs/report.md,
"Hang snapshot")::

    {"processes": [...], "groups": [...], "outliers": [{"pid", "rank", "reason", "stack"}],
     "findings": [HANG finding]}

Rules (docs/findings.md, HANG): workers are grouped by the (function, file) chain of their main
thread, outermost to innermost (line numbers ignored, so one call site reached through a
different line still groups). A worker is *in a collective* when a frame of its main thread is a
torch.distributed collective. Outliers:

1. when some workers are in a collective and others are not, the ones not in a collective
   (the others wait for them), provided they are at most half of the workers;
2. otherwise the workers outside the largest group, provided the largest group holds more than
   half of the workers (with no majority nobody can be called the odd one out) and they are not
   in a collective themselves (a worker in a collective waits for the others, it holds no one up).
"""
from __future__ import annotations

import os
from collections import Counter

# torch.distributed functions that block until every rank of the group has joined
COLLECTIVE_FUNCS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv", "batch_isend_irecv",
    "_all_gather_base", "_reduce_scatter_base", "all_reduce_coalesced", "all_gather_coalesced",
})
_DIST_FILES = ("torch/distributed/", "torch\\distributed\\")
HANG_MAX_OUTLIER_SHARE = 0.5  # outliers are the few: never more than half of the workers


def main_thread(proc: dict) -> dict | None:
    """The main thread of a dumped process (os thread id == pid, else 'MainThread', else the first)."""
    threads = proc.get("threads") or []
    for t in threads:
        if t.get("os_thread_id") == proc.get("pid"):
            return t
    for t in threads:
        if t.get("name") == "MainThread":
            return t
    return threads[0] if threads else None


def _short(path: str) -> str:
    p = (path or "").replace("\\", "/")
    for mark in ("site-packages/", "dist-packages/"):
        if mark in p:
            return p.split(mark, 1)[1]
    return os.path.basename(p)


def signature(frames: list[dict]) -> tuple:
    """Grouping key: (function, short file) of each frame, outermost first; Python frames only."""
    return tuple((f.get("function"), _short(f.get("file", ""))) for f in reversed(frames) if not f.get("native"))


def collective_of(frames: list[dict]) -> str | None:
    """The torch.distributed collective the stack is inside (innermost first), or None."""
    for f in frames:
        fn = (f.get("file") or "").replace("\\", "/")
        if f.get("function") in COLLECTIVE_FUNCS and any(d in fn for d in _DIST_FILES):
            return str(f["function"])
    return None


def user_frame(frames: list[dict]) -> dict | None:
    """The innermost frame outside torch, the standard library and site-packages."""
    for f in frames:
        fn = (f.get("file") or "").replace("\\", "/")
        if f.get("native") or "site-packages/" in fn or "dist-packages/" in fn or "/lib/python" in fn \
                or fn.startswith("<"):
            continue
        return f
    return None


def _where(f: dict | None) -> str:
    if not f:
        return "?"
    return f"{f.get('function')} ({_short(f.get('file', ''))}:{f.get('line')})"


def _brief(frames: list[dict], n: int = 6) -> list[str]:
    return [_where(f) for f in frames[:n]]


def analyse(processes: list[dict]) -> dict:
    """Group workers by main-thread stack and name the outliers (see the module doc)."""
    procs = []
    for i, p in enumerate(processes):
        t = main_thread(p) if p.get("ok", True) else None
        frames = (t or {}).get("frames", [])
        rank = p.get("rank")
        procs.append({**p, "rank": rank if rank is not None else i, "main_frames": frames,
                      "collective": collective_of(frames), "at": _where(user_frame(frames) or (frames[0] if frames else None))})
    ok = [p for p in procs if p.get("ok", True) and p["main_frames"]]
    groups: dict[tuple, list[dict]] = {}
    for p in ok:
        groups.setdefault(signature(p["main_frames"]), []).append(p)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), min(q["rank"] for q in g)))
    n = len(ok)
    out_groups = []
    for gid, g in enumerate(ordered):
        f = g[0]["main_frames"]
        for q in g:
            q["group"] = gid
        out_groups.append({"id": gid, "size": len(g), "ranks": sorted(q["rank"] for q in g),
                           "pids": [q["pid"] for q in sorted(g, key=lambda q: q["rank"])],
                           "collective": g[0]["collective"], "at": g[0]["at"], "innermost": _where(f[0] if f else None),
                           "stack": _brief(f, 12)})
    outliers: list[dict] = []
    in_coll = [p for p in ok if p["collective"]]
    not_coll = [p for p in ok if not p["collective"]]
    majority = out_groups[0] if out_groups else None
    if in_coll and not_coll and len(not_coll) <= HANG_MAX_OUTLIER_SHARE * n:
        colls = Counter(p["collective"] for p in in_coll).most_common()
        what = ", ".join(f"{c} ({k})" for c, k in colls)
        for p in sorted(not_coll, key=lambda q: q["rank"]):
            outliers.append({"pid": p["pid"], "rank": p["rank"], "host": p.get("host", ""),
                             "reason": f"not in a collective: at {p['at']} while {len(in_coll)} of {n} workers "
                                       f"wait in {what}",
                             "stack": _brief(p["main_frames"], 12)})
    elif majority and majority["size"] > HANG_MAX_OUTLIER_SHARE * n and len(out_groups) > 1:
        for p in sorted(ok, key=lambda q: q["rank"]):
            if p["group"] != 0 and not p["collective"]:
                outliers.append({"pid": p["pid"], "rank": p["rank"], "host": p.get("host", ""),
                                 "reason": f"stack differs from the majority ({majority['size']} of {n} at "
                                           f"{majority['at']}): at {p['at']}",
                                 "stack": _brief(p["main_frames"], 12)})
    failed = [p for p in procs if not (p.get("ok", True) and p["main_frames"])]
    for p in failed:
        p.setdefault("group", None)
    plain = [{k: v for k, v in p.items() if k not in ("main_frames",)} for p in procs]
    res = {"processes": plain, "groups": out_groups, "outliers": outliers,
           "failed": [{"pid": p["pid"], "rank": p["rank"], "error": p.get("error") or "no Python stack"} for p in failed]}
    res["findings"] = hang_findings(res)
    return res


def hang_findings(snap: dict) -> list[dict]:
    """HANG: the outlier workers of a hang snapshot (one finding; none without outliers)."""
    outs = snap.get("outliers") or []
    groups = snap.get("groups") or []
    if not outs:
        return []
    ranks = [o["rank"] for o in outs]
    major = groups[0] if groups else {}
    first = outs[0]
    wait = (f"the other {major.get('size')} worker(s) wait in {major.get('collective')}" if major.get("collective")
            else f"{major.get('size')} worker(s) are at {major.get('at')}")
    return [{
        "code": "HANG", "severity": "high",
        "title": f"rank(s) {', '.join(map(str, ranks[:8]))} hold up the job: {first['reason']}",
        "rank": ranks[0] if len(ranks) == 1 else None, "step": None, "where": first["stack"][0] if first["stack"] else "",
        "impact_us": 0.0,
        "evidence": {"outliers": outs, "groups": [{k: g[k] for k in ("id", "size", "ranks", "collective", "at")}
                                                   for g in groups]},
        "suggestion": (f"{wait}; rank {first['rank']} (pid {first['pid']}) is elsewhere, at {first['stack'][0] if first['stack'] else '?'}. "
                       "Look at why it does not reach the collective: a blocked data loader or file read, a rank-"
                       "dependent branch (only some ranks call the collective, or call them in another order), an "
                       "exception swallowed on that rank, or a deadlock. `aiprof stacks --native PID` shows its C++ "
                       "frames; set TORCH_NCCL_TRACE_BUFFER_SIZE to get NCCL's flight recorder on timeout."),
    }]


def format_text(res: dict) -> str:
    """Human-readable rendering of :func:`analyse`'s result."""
    lines = []
    n = sum(g["size"] for g in res["groups"])
    lines.append(f"{n} worker(s) in {len(res['groups'])} group(s) by main-thread stack")
    for g in res["groups"]:
        coll = f" · in {g['collective']}" if g["collective"] else ""
        rk = ", ".join(map(str, g["ranks"][:16])) + (" …" if len(g["ranks"]) > 16 else "")
        lines.append(f"  group {g['id']}: {g['size']} worker(s), ranks {rk}{coll}")
        for s in g["stack"][:6]:
            lines.append(f"      {s}")
    for f in res.get("failed", []):
        lines.append(f"  pid {f['pid']} (rank {f['rank']}): no stack: {f['error']}")
    if res["outliers"]:
        lines.append("Outliers:")
        for o in res["outliers"]:
            lines.append(f"  rank {o['rank']} (pid {o['pid']}): {o['reason']}")
    else:
        lines.append("Outliers: none (no minority of workers stands out)")
    for f in res.get("findings", []):
        lines.append(f"[{f['severity']}] {f['code']}  {f['title']}")
        lines.append(f"   → {f['suggestion']}")
    return "\n".join(lines) + "\n"
