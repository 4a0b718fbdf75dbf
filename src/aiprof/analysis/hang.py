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

Where the processes report their last collectives (``last_collectives``, from the agent's
recorder: agent/collectives.py), workers are also grouped by the last collective they entered
(process group, op, sequence number), and that comes first: on a process group, the workers whose
last sequence number is below the highest are *behind* (the others entered a collective they
have not reached; it cannot complete without them). The behind workers are the outliers when they
are at most half of those reporting; otherwise the few *ahead* are (they entered a collective the
others never called: a rank-dependent branch). Only when the recorder shows no such difference
do the stack rules above apply. This matters for NCCL, whose collectives return to Python at once:
the stacks of waiting ranks sit after the call (``.item()``, a sync), not inside it.
"""
from __future__ import annotations

import os
from collections import Counter

from aiprof.termtext import visible

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


RECORDER_SOURCES = ("flight_recorder", "python")


def recorded(proc: dict, source: str | None = None) -> tuple[str | None, list[dict]]:
    """(source, collective entries oldest first) a process reports; p2p entries left out.

    The flight recorder is preferred (it sees DDP's collectives too) when it has entries;
    ``source`` forces one of :data:`RECORDER_SOURCES`.
    """
    lc = proc.get("last_collectives")
    if not isinstance(lc, dict):
        return None, []
    for src in ((source,) if source else RECORDER_SOURCES):
        ents = [e for e in (lc.get(src) or []) if isinstance(e, dict) and not e.get("p2p")
                and isinstance(e.get("seq"), int)]
        if ents:
            return src, sorted(ents, key=lambda e: (e.get("t_ns") or 0, e["seq"]))
    return None, []


def _label(e: dict) -> str:
    return f"{e.get('op')} #{e.get('seq')}"


def recorder_verdict(procs: list[dict], source: str | None = None) -> dict | None:
    """Group workers by their last recorded collective; name those behind (or ahead).

    ``procs`` carry ``rank``, ``pid`` and ``last_collectives``. Returns None when fewer than two
    workers report entries, else ``{"source", "pg", "top_seq", "groups": [...], "behind": [...],
    "ahead": [...], "outliers": [...]}`` (docs/report.md, "Hang snapshot").
    """
    if source is None:  # one source for all: sequence numbers of different sources need not match
        have = {s: sum(1 for p in procs if recorded(p, s)[1]) for s in RECORDER_SOURCES}
        source = max(RECORDER_SOURCES, key=lambda s: (have[s], s == "flight_recorder"))
    rows = []
    for p in procs:
        _, ents = recorded(p, source)
        if ents:
            rows.append((p, ents))
    if len(rows) < 2:
        return None
    # the process group most workers report on; each worker's last entry on it
    pg_count = Counter(str(e.get("pg")) for _, ents in rows for e in {str(x.get("pg")): x for x in ents}.values())
    pg = pg_count.most_common(1)[0][0]
    last: dict[int, dict] = {}
    for p, ents in rows:
        on = [e for e in ents if str(e.get("pg")) == pg]
        if on:
            last[p["rank"]] = max(on, key=lambda e: e["seq"])
    if len(last) < 2:
        return None
    top = max(e["seq"] for e in last.values())
    by_key: dict[tuple, list[int]] = {}
    for r, e in last.items():
        by_key.setdefault((e["seq"], e.get("op")), []).append(r)
    groups = []
    for (seq, op), ranks in sorted(by_key.items(), key=lambda kv: (-kv[0][0], kv[0][1] or "")):
        e = last[ranks[0]]
        state = "waiting" if seq == top and len(by_key) > 1 else ("behind" if seq < top else "same")
        groups.append({"op": op, "seq": seq, "pg": pg, "ranks": sorted(ranks), "size": len(ranks), "state": state,
                       "label": (f"in {_label(e)}" if state == "waiting" else f"last collective {_label(e)}"),
                       "entry_state": e.get("state")})
    n = len(last)
    behind = sorted(r for r, e in last.items() if e["seq"] < top)
    ahead = sorted(r for r, e in last.items() if e["seq"] == top) if behind else []
    top_e = next(e for e in last.values() if e["seq"] == top)
    outliers = []
    if behind and len(behind) <= HANG_MAX_OUTLIER_SHARE * n:
        for r in behind:
            e = last[r]
            outliers.append({"rank": r, "kind": "behind",
                             "reason": f"behind: last collective {_label(e)} while {len(ahead)} of {n} workers "
                                       f"are in {_label(top_e)} (process group {pg}, {source})"})
    elif ahead and len(ahead) <= HANG_MAX_OUTLIER_SHARE * n:
        low = min(last[r]["seq"] for r in behind)
        for r in ahead:
            outliers.append({"rank": r, "kind": "ahead",
                             "reason": f"ahead: entered {_label(last[r])}, which {len(behind)} of {n} workers have "
                                       f"not reached (they are at #{low}..#{top - 1}; a collective only some ranks "
                                       f"call?) (process group {pg}, {source})"})
    return {"source": source, "pg": pg, "top_seq": top, "groups": groups, "behind": behind, "ahead": ahead,
            "last": {r: {k: last[r].get(k) for k in ("op", "seq", "pg", "state", "t_ns")} for r in sorted(last)},
            "outliers": outliers}


def analyse(processes: list[dict], recorder_source: str | None = None) -> dict:
    """Group workers by main-thread stack and last collective; name the outliers (module doc).

    ``recorder_source`` forces the recorder source ("flight_recorder" or "python"); by default the
    one most workers report is used.
    """
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
    rec = recorder_verdict([p for p in procs if p.get("last_collectives")], recorder_source)
    if rec is not None:
        label = {r: g["label"] for g in rec["groups"] for r in g["ranks"]}
        for p in procs:
            if p["rank"] in label:
                p["last_collective"] = {**rec["last"][p["rank"]], "label": label[p["rank"]]}
        for g in out_groups:
            labels = {label.get(r) for r in g["ranks"]}
            g["recorded"] = labels.pop() if len(labels) == 1 else None
            if not g["collective"] and g["recorded"] and g["recorded"].startswith("in "):
                g["collective"] = g["recorded"][3:].split(" #")[0]  # NCCL: the stack left the call
        by_rank = {p["rank"]: p for p in procs}
        for o in rec["outliers"]:
            p = by_rank[o["rank"]]
            frames = p["main_frames"]
            where = f"; at {p['at']}" if frames else ""
            outliers.append({"pid": p["pid"], "rank": p["rank"], "host": p.get("host", ""), "kind": o["kind"],
                             "reason": o["reason"] + where, "stack": _brief(frames, 12)})
    in_coll = [p for p in ok if p["collective"]]
    not_coll = [p for p in ok if not p["collective"]]
    majority = out_groups[0] if out_groups else None
    if outliers:
        pass  # the recorder named them
    elif in_coll and not_coll and len(not_coll) <= HANG_MAX_OUTLIER_SHARE * n:
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
           "collectives": None if rec is None else {k: rec[k] for k in ("source", "pg", "top_seq", "groups")},
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
    coll = snap.get("collectives") or {}
    waiting = next((g for g in coll.get("groups") or [] if g.get("state") == "waiting"), None)
    if waiting and first.get("kind") == "behind":
        wait = f"rank(s) {', '.join(map(str, waiting['ranks'][:8]))} wait {waiting['label']}"
    elif major.get("collective"):
        wait = f"the other {major.get('size')} worker(s) wait in {major.get('collective')}"
    else:
        wait = f"{major.get('size')} worker(s) are at {major.get('at')}"
    if first.get("kind") == "ahead":
        look = ("Look at why it called a collective the others did not: a rank-dependent branch (a collective "
                "inside `if rank == 0`), a different number of batches or iterations per rank, or collectives "
                "issued in a different order. ")
    else:
        look = ("Look at why it does not reach the collective: a blocked data loader or file read, a rank-"
                "dependent branch (only some ranks call the collective, or call them in another order), an "
                "exception swallowed on that rank, or a deadlock. ")
    return [{
        "code": "HANG", "severity": "high",
        "title": f"rank(s) {', '.join(map(str, ranks[:8]))} hold up the job: {first['reason']}",
        "rank": ranks[0] if len(ranks) == 1 else None, "step": None, "where": first["stack"][0] if first["stack"] else "",
        "impact_us": 0.0,
        "evidence": {"outliers": outs, "groups": [{k: g.get(k) for k in ("id", "size", "ranks", "collective", "at",
                                                                       "recorded")} for g in groups],
                     "collectives": coll.get("groups") or None},
        "suggestion": (f"{wait}; rank {first['rank']} (pid {first['pid']}) is elsewhere, at {first['stack'][0] if first['stack'] else '?'}. "
                       + look + "`aiprof stacks --native PID` shows its C++ frames; TORCH_FR_BUFFER_SIZE "
                       "(TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.9) turns on torch's flight recorder, which "
                       "`aiprof run` does for you."),
    }]


def format_text(res: dict) -> str:
    """Human-readable rendering of :func:`analyse`'s result."""
    lines = []
    n = sum(g["size"] for g in res["groups"])
    lines.append(f"{n} worker(s) in {len(res['groups'])} group(s) by main-thread stack")
    for g in res["groups"]:
        coll = f" · in {g['collective']}" if g["collective"] else ""
        if g.get("recorded"):
            coll += f" · recorder: {g['recorded']}"
        rk = ", ".join(map(str, g["ranks"][:16])) + (" …" if len(g["ranks"]) > 16 else "")
        lines.append(f"  group {g['id']}: {g['size']} worker(s), ranks {rk}{coll}")
        for s in g["stack"][:6]:
            lines.append(f"      {s}")
    rec = res.get("collectives")
    if rec:
        lines.append(f"Last collective entered (process group {rec['pg']}, {rec['source']}):")
        for g in rec["groups"]:
            rk = ", ".join(map(str, g["ranks"][:16])) + (" …" if len(g["ranks"]) > 16 else "")
            lines.append(f"  ranks {rk}: {g['label']}")
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
    # frame, file and thread names come from the job's code: no control character reaches the terminal
    return "\n".join(visible(line) for line in lines) + "\n"
