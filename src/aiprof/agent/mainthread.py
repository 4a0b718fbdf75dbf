"""Run a function on the interpreter's main thread, from any thread, via ``Py_AddPendingCall``.

Used for time-based captures (no iteration boundary to hook): torch.profiler must be started
and stopped on the thread that runs the work, which for such jobs is the main thread. The
function runs between two bytecodes of the main thread, with the GIL held, the next time it
executes Python code (a main thread blocked in a long C call delays it).
"""
from __future__ import annotations

import collections
import ctypes
from typing import Callable

from aiprof.agent import log

_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# Keep callbacks alive until long after they ran: freeing a thunk while C still calls it crashes.
_alive: collections.deque = collections.deque(maxlen=64)
_api = None


def call_soon_in_main_thread(fn: Callable[[], None]) -> bool:
    """Schedule ``fn()`` on the main thread; returns False when the interpreter refused it."""
    global _api
    if _api is None:
        api = ctypes.pythonapi.Py_AddPendingCall
        api.argtypes = [_CB, ctypes.c_void_p]
        api.restype = ctypes.c_int
        _api = api

    def thunk(_arg: object) -> int:
        try:
            fn()
        except Exception as exc:  # never let an exception escape into the main thread
            log.error("main-thread call", exc)
        return 0

    cb = _CB(thunk)
    _alive.append(cb)
    return _api(cb, None) == 0
