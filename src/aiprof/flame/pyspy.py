"""py-spy samples as a CPU flame graph (native + Python frames where py-spy unwound them).

Three inputs, all py-spy's own formats or aiprof's wrapper of them:

* ``py-spy record --format raw`` (collapsed stacks ``frame;frame count``, root first), which
  with ``--native`` includes C/C++ frames;
* ``py-spy record --format speedscope`` (one sampled profile per thread);
* the dumps of :func:`aiprof.attach.stacks.dump_stacks` (``aiprof stacks``): each dump is one
  sample of every thread, innermost frame first.

aiprof has no py-spy *sampling* function yet (``aiprof stacks`` takes single dumps), so
recording is left to ``py-spy record``; these readers turn its output into a
:class:`~aiprof.flame.profile.Profile` (unit: samples).
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from aiprof.errors import AiprofError
from aiprof.flame import folded
from aiprof.flame.profile import Profile, Stack, from_dict


def _frame(name: str | None, file: str | None, line: Any) -> str:
    fn = name or "?"
    if file:
        short = file.rsplit("/", 1)[-1]
        return f"{fn} ({short}:{line})" if line else f"{fn} ({short})"
    return fn


def from_dumps(dumps: Iterable[dict], name: str = "py-spy dumps", per_thread: bool = True) -> Profile:
    """Profile of ``aiprof stacks`` dumps: every thread of every dump is one sample."""
    out: dict[Stack, int] = {}
    for d in dumps:
        if not d.get("ok"):
            continue
        for t in d.get("threads", []):
            frames = tuple(_frame(f.get("function"), f.get("file"), f.get("line")) for f in reversed(t.get("frames", [])))
            if per_thread:
                frames = (f"pid {d.get('pid')} {t.get('name') or 'thread'} {t.get('os_thread_id') or ''}".strip(),) + frames
            out[frames] = out.get(frames, 0) + 1
    return from_dict(name, out, unit="samples")


def read_speedscope(doc: dict, name: str = "py-spy") -> Profile:
    """Profile of a py-spy speedscope file: samples of all threads, each thread a root frame."""
    frames = doc.get("shared", {}).get("frames", [])
    labels = [_frame(f.get("name"), f.get("file"), f.get("line")) for f in frames]
    out: dict[Stack, int] = {}
    for prof in doc.get("profiles", []):
        if prof.get("type") != "sampled":
            raise AiprofError("only sampled speedscope profiles (py-spy's) can be read")
        root = prof.get("name") or "thread"
        # py-spy's weights are the sampling interval in seconds: count samples instead
        for sample in prof.get("samples", []):
            key = (root,) + tuple(labels[i] for i in sample)
            out[key] = out.get(key, 0) + 1
    return from_dict(name, out, unit="samples")


def read(path: str) -> Profile:
    """Read py-spy output (speedscope JSON, raw/collapsed text, or an ``aiprof stacks --json`` file)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise AiprofError(f"{path}: {exc.strerror}") from None
    head = text.lstrip()[:1]
    if head in ("{", "["):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise AiprofError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(doc, dict) and "profiles" in doc:
            return read_speedscope(doc, name=f"py-spy {path.rsplit('/', 1)[-1]}")
        dumps = doc if isinstance(doc, list) else doc.get("dumps", doc.get("processes", []))
        return from_dumps(dumps, name=f"py-spy dumps {path.rsplit('/', 1)[-1]}")
    import io

    try:
        return folded.read(io.StringIO(text), name=f"py-spy {path.rsplit('/', 1)[-1]}", unit="samples")
    except ValueError:
        raise AiprofError(f"{path}: neither speedscope JSON nor py-spy raw (collapsed) stacks") from None
