"""Detach CUPTI when a capture stops, so that the job's CUDA calls run as fast as before it.

Kineto keeps CUPTI attached after torch.profiler stops unless ``TEARDOWN_CUPTI=1`` (libkineto
reads it with getenv at every stop): CUPTI's callbacks stay subscribed and every CUDA call the
job makes pays for them, for the rest of the process. Measured on an H200 (GPT-2 124M, bf16,
fused AdamW; plain torch.profiler recording 5 steps; median step after the capture over the
median before): 1.080 with the variable unset, 1.107 with 0, **1.014 with 1**, against 1.011
for the same job with no capture at all. Through the agent (no teardown yet) the steps after a
capture ran 1.17-1.29x slower on the H200 and 1.3x on an H100.

Teardown is not safe everywhere: PyTorch's inductor turns it off when it compiles with CUDA
graphs (re-initialising CUPTI after a teardown crashed graph replays on CUDA 11 and 12). So the
agent sets it only where it sees no CUDA graphs, and the job's own setting always wins.
"""
from __future__ import annotations

import os
import sys
from typing import Any

ENV = "TEARDOWN_CUPTI"
# engines that replay CUDA graphs by default
GRAPH_ENGINES = ("vllm", "sglang", "tensorrt_llm")

_state: dict[str, Any] = {"ours": False, "graphs": False, "hooked": False}


def watch_graphs() -> None:
    """Note any CUDA graph the job captures from now on (a wrapper on ``CUDAGraph.capture_begin``,
    called once per graph capture, never per replay). Idempotent; never raises."""
    if _state["hooked"]:
        return
    try:
        graphs = sys.modules.get("torch.cuda.graphs")
        cls = getattr(graphs, "CUDAGraph", None) if graphs is not None else None
        if cls is None:
            return
        orig = cls.capture_begin

        def capture_begin(self: Any, *a: Any, **kw: Any) -> Any:
            _state["graphs"] = True
            return orig(self, *a, **kw)

        cls.capture_begin = capture_begin
        _state["hooked"] = True
    except Exception:  # a torch without it: the other signs below still count
        pass


def graphs_in_use() -> str | None:
    """Why the job counts as using CUDA graphs (None when no sign of them)."""
    if _state["graphs"]:
        return "the job captured a CUDA graph"
    for mod in GRAPH_ENGINES:
        if mod in sys.modules:
            return f"{mod} is loaded (it replays CUDA graphs)"
    cfg = sys.modules.get("torch._inductor.config")
    try:
        if cfg is not None and getattr(cfg.triton, "cudagraphs", False):
            return "torch.compile uses CUDA graphs (inductor's triton.cudagraphs)"
    except Exception:
        pass
    return None


def decide() -> dict[str, Any]:
    """Before ``stop_trace``: set ``TEARDOWN_CUPTI=1`` unless the job set it or uses CUDA graphs.
    Returns what was decided and why, for meta.json. Never raises."""
    try:
        have = os.environ.get(ENV)
        if have is not None and not _state["ours"]:
            return {"teardown": have == "1", "why": f"{ENV}={have} set by the job"}
        why = graphs_in_use()
        if why:
            if _state["ours"]:  # set by an earlier capture, before the graphs: take it back
                os.environ.pop(ENV, None)
                _state["ours"] = False
            return {"teardown": False, "why": f"{why}: CUPTI stays attached, CUDA calls may stay slower after "
                                              "the capture"}
        os.environ[ENV] = "1"
        _state["ours"] = True
        return {"teardown": True, "why": "no CUDA graphs seen: CUPTI detached at stop"}
    except Exception as exc:
        return {"teardown": None, "why": f"not decided: {type(exc).__name__}: {exc}"}
