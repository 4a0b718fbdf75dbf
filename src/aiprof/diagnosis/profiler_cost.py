"""The profiler's own cost on the host, so that what-if shares refer to the unprofiled job.

torch.profiler makes the host slower: every recorded op runs RecordFunction callbacks (and
records its input shapes), every CUDA runtime call goes through a CUPTI callback, and with
Python stacks every Python call and return goes through the tracer. GPU work is not slowed
(kernels are recorded by the hardware's activity buffers). A host-heavy step is therefore
inflated (a launch-bound loop measured here: 19 ms unprofiled, 35–45 ms traced) while a GPU-bound
one is not, so a saving computed on the profiled timeline would be a wrong share of the real step.

The replay subtracts the costs below from the host time in which each recorded event started.
They were measured on the lent H100 (torch 2.11, CUDA 13) by ``bench/diagnosis/gpu_pairs.py
calibration`` (jobs separate from the validation pairs): each loop timed unprofiled and
profiled in the same process, the extra host time divided by the events the trace holds per
step. Definitions and the measurement in docs/findings.md ("Profiler inflation").
"""
from __future__ import annotations

from dataclasses import dataclass

# Measured on the lent H100 (torch 2.11, CUDA 13) by ``bench/diagnosis/gpu_pairs.py calibration``:
# four loops, each stressing one kind of event, timed unprofiled and profiled in interleaved
# repetitions; least squares of the extra host time per step on the events per step.
# Per recorded torch op: RecordFunction enter/exit (3.6 µs), 4.5 µs when input shapes are recorded.
OP_NS = 3_600.0
OP_SHAPES_NS = 4_500.0
# Per CUDA runtime/driver call (CUPTI callback on entry and exit).
RUNTIME_NS = 300.0
# Per Python function event and per builtin (C function) event, only when stacks were captured.
PYTHON_NS = 480.0
BUILTIN_NS = 320.0
# A host interval is never deflated below this share of its profiled length: the overhead
# model is an average, and a gap made of nothing but events must not vanish entirely.
MIN_KEPT_SHARE = 0.1


@dataclass(frozen=True)
class ProfilerCost:
    """Host nanoseconds the profiler adds per recorded event of each kind."""

    op_ns: float = OP_NS
    op_shapes_ns: float = OP_SHAPES_NS
    runtime_ns: float = RUNTIME_NS
    python_ns: float = PYTHON_NS
    builtin_ns: float = BUILTIN_NS

    @classmethod
    def none(cls) -> ProfilerCost:
        """No deflation: replay the profiled timeline as it was recorded."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0)


DEFAULT = ProfilerCost()
