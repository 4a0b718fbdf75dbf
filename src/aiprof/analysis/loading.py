"""Data loading: the one definition that the steps table, the GPU-idle classes and the causes read.

Definition in docs/metrics.md ("Data loading"). The *training thread* is the thread that runs the
loop (:func:`main_tid`); its *data loading* is the time it spends inside a data-loading event:
a DataLoader iteration (``enumerate(DataLoader)…`` annotations, ``torch/utils/data/`` frames) or
a user function that fetches input (``get_batch``, ``__getitem__``, ``collate``…). A library's
own ``__getitem__`` (a transformers ``BatchEncoding``, ``os.environ``) is not input.

Per step, the breakdown's ``dataloader_us`` is the union of those intervals inside the step
window; the GPU-idle class ``host: data loading`` is its part while the GPU is idle;
DATALOADER_STARVED reads the breakdown's figure and finds its stalls in it.
"""
from __future__ import annotations

import numpy as np

from aiprof import npx
from aiprof.analysis.intervals import Union, union
from aiprof.analysis.memo import analysis_cache
from aiprof.trace.store import RankTrace

# Frames from these places are library code: the "user site" of an event is the nearest
# ancestor frame that is none of these.
_LIBRARY_PREFIXES = ("torch/", "transformers/", "accelerate/", "deepspeed/", "triton/", "numpy/",
                     "threading.py", "contextlib.py", "functools.py", "<built-in", "nn.Module:",
                     "tqdm/", "lightning/", "pytorch_lightning/", "apex/", "megatron/", "vllm/",
                     "importlib", "runpy.py", "<frozen", "site-packages/", "dist-packages/",
                     # aiprof's own agent (its collective wrappers run inside the job's calls)
                     "aiprof/")
# Host names that mean "loading input": DataLoader iteration, get_batch-like user functions.
_DATA_LOADING_WORDS = ("get_batch", "next_batch", "load_batch", "fetch_batch", "collate",
                       "dataloader", "__getitem__", "_next_data", "read_batch")
# Host names that mean "preparing input" beyond loading it: the work a DataLoader's workers (or a
# process pool) can do ahead of the GPU. Only such work is told to move there (issue 28, item 2).
_INPUT_PREPARATION_WORDS = ("tokeniz", "tokenis", "transform", "augment", "preprocess", "encode", "detokeniz",
                            "decode_image", "resize", "normaliz", "pad_batch", "make_batch", "prepare_batch")
# The one library whose frames are input loading: torch's DataLoader (its frames, its annotations).
_TORCH_DATA = ("torch/utils/data/", "enumerate(DataLoader)", "DataLoader")
STEP_ANNOTATION = "ProfilerStep#"
# Tables whose host events can be data loading (their rows have ts, dur, tid, name).
_HOST_TABLES = ("python", "ops", "annotations")


def is_library_frame(name: str) -> bool:
    """True for frames of torch, common ML libraries, the standard library, C builtins."""
    return name.startswith(_LIBRARY_PREFIXES) or "site-packages/" in name or "/lib/python" in name


def is_data_loading(name: str) -> bool:
    """True for host events that load input: DataLoader iteration, or a get_batch-like function
    that is not a library's own (a library's ``__getitem__`` is no input)."""
    n = name.lower()
    if n.startswith("enumerate(dataloader)"):
        return True
    if not any(w in n for w in _DATA_LOADING_WORDS):
        return False
    return not is_library_frame(name) or name.startswith(_TORCH_DATA)


def is_input_preparation(name: str) -> bool:
    """True for host events that load or prepare input (tokenise, transform, collate, a DataLoader,
    a get_batch-like function): the work that can run in DataLoader workers ahead of the GPU."""
    if is_data_loading(name):
        return True
    n = name.lower()
    # a library's own transform (torch.nn's, a model's encode) is no input step; a tokenizer's is
    if is_library_frame(name) and not name.startswith(_TORCH_DATA) and "tokeniz" not in n:
        return False
    return any(w in n for w in _INPUT_PREPARATION_WORDS)


def main_tid(rt: RankTrace) -> int:
    """The thread that runs the training loop: the one with ProfilerStep annotations, else the
    one with most Python frames / ops."""
    a = rt.annotations
    if len(a):
        m = a.strings("name").isin_labels(lambda s: s.startswith(STEP_ANNOTATION)) & ~a["gpu"]
        if m.any():
            return int(a["tid"][m][0])
    for name in ("python", "ops", "runtime"):
        t = rt.table(name)
        if len(t):
            vals, counts = npx.unique(t["tid"], return_counts=True)
            return int(vals[np.argmax(counts)])
    return -1


def loading_union(rt: RankTrace) -> Union:
    """The training thread's time inside data-loading events (cached on the rank object)."""
    cache = analysis_cache(rt)
    if "loading_union" in cache:
        return cache["loading_union"]
    tid = main_tid(rt)
    starts, ends = [], []
    for name in _HOST_TABLES:
        t = rt.table(name)
        if not len(t):
            continue
        m = t.strings("name").isin_labels(is_data_loading) & (t["tid"] == tid) & (t["dur"] > 0)
        if name == "annotations":
            m &= ~t["gpu"]
        starts.append(t["ts"][m])
        ends.append((t["ts"] + t["dur"])[m])
    u = union(np.concatenate(starts), np.concatenate(ends)) if starts else union(np.zeros(0), np.zeros(0))
    cache["loading_union"] = u
    return u
