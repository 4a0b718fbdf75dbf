"""Iteration boundaries: a global optimizer step hook, or a wrapped ``module:qualname`` entry.

Both call :class:`StepListener` methods on the thread that runs the step:
``step_begin(k)`` when iteration ``k`` starts and ``step_end(k)`` when it ends. With the
optimizer hook an iteration ends at ``optimizer.step()`` and the next begins at once, so the
annotation spans data loading, forward, backward and the optimizer step of one iteration.

The hot path (once per iteration while idle) is a counter, a clock read and a deque append.
"""
from __future__ import annotations

import collections
import functools
import sys
import threading
import time
import weakref
from typing import Any, Callable, Protocol

from aiprof.agent import log


class EntryUnavailable(Exception):
    """The ``--entry`` function cannot be wrapped in this process, and never will be."""


def _not_yet(mod: Any, missing: str) -> bool:
    """False (retry later) while ``mod`` is still being imported, its names not all defined yet;
    once it has finished, the name is not coming: :class:`EntryUnavailable`. A ``__main__``
    (the job's script, run rather than imported) defines its names as it runs: always retry."""
    spec = getattr(mod, "__spec__", None)
    if getattr(mod, "__name__", "") == "__main__" or spec is None or getattr(spec, "_initializing", False):
        return False
    raise EntryUnavailable(f"{missing} (not in the installed version?)")


class StepListener(Protocol):
    """What the step tracker calls at iteration boundaries (the capture driver)."""

    def step_begin(self, k: int) -> None: ...

    def step_end(self, k: int) -> None: ...


class StepTracker:
    """Counts iterations, keeps their recent durations and forwards boundaries to a listener."""

    def __init__(self, listener: StepListener, history: int = 512) -> None:
        self.listener = listener
        self.count = 0  # iterations completed
        self.source = "none"
        self.last_boundary: float | None = None  # perf_counter of the last boundary
        self.last_boundary_unix_ns: int | None = None
        self.durations: collections.deque[float] = collections.deque(maxlen=history)  # seconds
        self._hook_handle: Any = None
        self._lead_opt: Any = None  # weakref to the optimizer whose steps define iterations
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []

    # -- shared bookkeeping -------------------------------------------------------------------
    def _ended(self, now: float) -> None:
        if self.last_boundary is not None:
            self.durations.append(now - self.last_boundary)
        self.last_boundary = now
        self.last_boundary_unix_ns = time.time_ns()

    def recent_ms(self, n: int = 50) -> list[float]:
        """The last ``n`` iteration durations in milliseconds, oldest first."""
        xs = list(self.durations)[-n:]
        return [round(x * 1e3, 3) for x in xs]

    def median_ms(self, n: int = 50) -> float | None:
        """Median of the last ``n`` iteration durations (ms), or None before two boundaries."""
        xs = sorted(self.recent_ms(n))
        return xs[len(xs) // 2] if xs else None

    def seconds_since_boundary(self) -> float | None:
        """Seconds since the last iteration boundary, None if none was ever seen."""
        return None if self.last_boundary is None else time.perf_counter() - self.last_boundary

    # -- optimizer hook -----------------------------------------------------------------------
    def install_optimizer_hook(self) -> None:
        """Register the global optimizer step post-hook (torch must already be imported)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook_handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        self.source = "optimizer"

    def remove_optimizer_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    def _on_optimizer_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        try:
            # Several optimizers (GANs, per-module optimizers): the first one seen defines
            # iterations, the others are ignored; if it is collected the next one takes over.
            lead = self._lead_opt() if self._lead_opt is not None else None
            if lead is None:
                self._lead_opt = weakref.ref(opt)
            elif lead is not opt:
                return
            now = time.perf_counter()
            k = self.count
            self.count = k + 1
            self._ended(now)
            self.listener.step_end(k)
            self.listener.step_begin(k + 1)
        except Exception as exc:  # never raise into optimizer.step()
            log.error("optimizer step hook", exc)

    # -- entry wrapping -----------------------------------------------------------------------
    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``fn`` wrapped so each outermost call is one iteration."""
        tracker = self
        local = self._local

        @functools.wraps(fn)
        def aiprof_step(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            if depth == 0:
                tracker._entry_begin()
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth
                if depth == 0:
                    tracker._entry_end()

        aiprof_step.__aiprof_wrapped__ = fn  # type: ignore[attr-defined]
        return aiprof_step

    def _entry_begin(self) -> None:
        try:
            if self.last_boundary is None:
                self.last_boundary = time.perf_counter()
            self.listener.step_begin(self.count)
        except Exception as exc:
            log.error("entry wrapper", exc)

    def _entry_end(self) -> None:
        try:
            now = time.perf_counter()
            k = self.count
            self.count = k + 1
            # entry mode: an iteration is call start to call start (includes the gap), so the
            # step time is comparable to the optimizer mode's
            self._ended(now)
            self.listener.step_end(k)
        except Exception as exc:
            log.error("entry wrapper", exc)

    def try_patch_entry(self, entry: str) -> bool:
        """Wrap ``module:qualname`` if the module is imported and the name defined.

        Never imports the module itself (importing user code has side effects); returns False
        when it is not there yet, so the caller can retry later. Raises :class:`EntryUnavailable`
        when it never will be: the module has finished importing without that name (a private
        function of transformers or vLLM renamed or moved in the installed version), or the name
        is no function (wrapping a class would break the job's isinstance checks).
        """
        mod_name, _, qual = entry.partition(":")
        mod = sys.modules.get(mod_name)
        if mod is None:
            return False
        parts = qual.split(".")
        owner: Any = mod
        for i, p in enumerate(parts[:-1]):
            owner = getattr(owner, p, None)
            if owner is None:
                return _not_yet(mod, f"{mod_name} has no {'.'.join(parts[:i + 1])}")
        name = parts[-1]
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if raw is None:
            return _not_yet(mod, f"{mod_name} has no {qual}")
        if isinstance(raw, (staticmethod, classmethod)):
            inner = raw.__func__
            if getattr(inner, "__aiprof_wrapped__", None) is not None:
                return True
            new: Any = type(raw)(self.wrap(inner))
        else:
            if getattr(raw, "__aiprof_wrapped__", None) is not None:
                return True
            if isinstance(raw, type) or not callable(raw):
                raise EntryUnavailable(f"{qual} is a {type(raw).__name__}, not a function")
            new = self.wrap(raw)
        setattr(owner, name, new)
        self._patched.append((owner, name, raw))
        self.source = f"entry:{entry}"
        self.remove_optimizer_hook()
        return True

    def unpatch(self) -> None:
        """Restore every wrapped entry (used on agent shutdown)."""
        for owner, name, raw in reversed(self._patched):
            try:
                setattr(owner, name, raw)
            except Exception:
                pass
        self._patched.clear()
