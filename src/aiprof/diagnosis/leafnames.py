"""The names users know for the leaves of the critical path (diagnosis/critical_path.py): a
builtin or library call by what it is (``gc.collect``, a file read), a frame by its function and
file, without the object addresses that change from run to run."""
from __future__ import annotations

import re

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

# Builtins and library calls a leaf can be named by, with what to do about each when it runs on
# the training thread every step: (label test, the name users know, the remedy). The remedy
# follows from what the call is, never from where it sits (issue 28, item 2).
_NAMED_LEAVES = (
    (lambda s: s == "<built-in function collect>", "gc.collect",
     "don't call it every step (or call gc.freeze() once after setup, so collections stop scanning the "
     "long-lived objects)"),
    (lambda s: s == "<built-in function sleep>", "time.sleep", "remove the sleep from the step"),
    (lambda s: s == "<built-in function print>", "print",
     "log every N steps (a GPU value printed is also a sync: keep it on the GPU until then)"),
    (lambda s: "logging/__init__.py" in s, "logging",
     "log every N steps (a GPU value logged is also a sync: keep it on the GPU until then)"),
    (lambda s: s.startswith(("<built-in method read of _io", "<built-in method readinto of _io",
                             "<built-in method readline", "<built-in function open>")), "a file read",
     "read it once before the loop, or in a background thread ahead of the step"),
)


# Events the profiler itself names, by what they are: "PythonSubclass" is the dispatch of an op on
# a tensor subclass implemented in Python (its __torch_dispatch__): DTensor, the parameters of FSDP2
# and tensor parallelism, among them. Its time is that Python, on top of the op's.
_EVENT_NAMES = {
    "PythonSubclass": "PythonSubclass (an op's dispatch through a Python tensor subclass, e.g. FSDP2's DTensor)",
}


def named_leaf(label: str) -> tuple[str, str]:
    """(the name users know, what to do) of a leaf the project recognises; ("", "") otherwise."""
    for test, name, advice in _NAMED_LEAVES:
        if test(label):
            return name, advice
    return "", ""


def leaf_display(label: str) -> str:
    """A leaf as the report names it: a known call by its name (``gc.collect``), a Python frame
    'path/file.py(12): func' as ``func`` (file.py(12)), a builtin by its label."""
    name, _ = named_leaf(label)
    if name:
        return name
    if label in _EVENT_NAMES:
        return _EVENT_NAMES[label]
    label = _ADDRESS.sub("", label)
    m = re.match(r"(.*?)\((\d+)\): (.*)$", label)
    if m:
        return f"{m.group(3)} ({m.group(1).rsplit('/', 1)[-1]}({m.group(2)}))"
    return label
