"""Cause detectors, one module per mechanism (docs/findings.md lists them), and their one
ordered registry.

Each module declares ``DETECTOR`` (diagnosis/detector.py): its code, scope, the facts it reads
and ``detect(facts) -> list[Cause]`` with evidence, place, a specific remedy and the fix as an
:class:`~aiprof.diagnosis.replay.Edit` that is priced by replay. The engine runs
:data:`REGISTRY` in order, scope by scope; adding a cause is one module and one line here
(docs/architecture.md, "Add a cause").
"""
from __future__ import annotations

import os

from aiprof.diagnosis.causes import (
    allocator_churn,
    anomaly_mode,
    comm_overlap,
    conv_layout,
    data_parallel,
    dataloader,
    decode_launch_bound,
    eager_attention,
    fsdp_prefetch,
    fsdp_regather,
    fsdp_units,
    grad_accum,
    host_preprocessing,
    host_sampling,
    host_scheduling,
    host_stall,
    host_sync,
    idle_sms,
    kv_cache_copy,
    launch_bound,
    matmul_alignment,
    matmul_precision,
    new_shapes,
    pageable_copy,
    prefill_stall,
    slow_interconnect,
    small_batch,
    straggler,
    sync_checkpoint,
    syscall_blocked,
    uncompiled_runs,
    unexplained,
    unfused_optimizer,
    unfused_pointwise,
    zeroed_grads,
)
from aiprof.diagnosis.detector import Detector, Scope

# Order matters within a scope. The serving detectors (host_sampling .. small_batch) act only on
# inference traces of a language model (analysis/serving.py); decode_launch_bound claims the
# decode iterations' launches, so it runs before the generic launch_bound, which runs last and
# prices what the specific detectors before it left (the host regions they claimed are left out).
REGISTRY: tuple[Detector, ...] = (
    allocator_churn.DETECTOR,
    new_shapes.DETECTOR,
    unfused_optimizer.DETECTOR,
    zeroed_grads.DETECTOR,
    # before the syncs: the engine's NaN checks read a value per backward output; their fix is
    # turning anomaly mode off, not batching the reads
    anomaly_mode.DETECTOR,
    # before the syncs and copies: those inside a save are the checkpoint's (its fix removes them)
    sync_checkpoint.DETECTOR,
    host_sync.DETECTOR,
    pageable_copy.DETECTOR,
    syscall_blocked.DETECTOR,
    dataloader.DETECTOR,
    host_preprocessing.DETECTOR,
    host_sampling.DETECTOR,
    host_scheduling.DETECTOR,
    # after the causes that own host regions (a get_batch that sleeps is DATALOADER_STARVED's)
    host_stall.DETECTOR,
    kv_cache_copy.DETECTOR,
    prefill_stall.DETECTOR,
    small_batch.DETECTOR,
    matmul_precision.DETECTOR,
    matmul_alignment.DETECTOR,
    # the attention's kernels first: the elementwise chains leave them out (its fix removes them)
    eager_attention.DETECTOR,
    unfused_pointwise.DETECTOR,
    conv_layout.DETECTOR,
    idle_sms.DETECTOR,
    # what the compiler fuses once the specific kernel causes above have made their fixes
    uncompiled_runs.ON_ONE_RANK,
    # one process driving several GPUs: its host is LAUNCH_BOUND's symptom, one process per GPU the fix
    data_parallel.DETECTOR,
    decode_launch_bound.DETECTOR,
    launch_bound.DETECTOR,
    slow_interconnect.ON_ONE_RANK,
    uncompiled_runs.DETECTOR,
    fsdp_regather.DETECTOR,
    fsdp_prefetch.DETECTOR,
    fsdp_units.DETECTOR,
    grad_accum.DETECTOR,
    slow_interconnect.DETECTOR,
    # EXPOSED_BUCKET_COMM failed its validation pair: on two NVLink H200s, one 384 MB bucket vs
    # DDP's 25 MB buckets measured 0.8 % apart, and it predicted 14.2 % (docs/findings.md, Validation)
    comm_overlap.DETECTOR,
    straggler.DETECTOR,
    # last of the rank detectors (Detector.last): names the critical path's leaves no cause claims
    unexplained.DETECTOR,
)
# Detectors marked experimental run only when named here (comma-separated codes).
EXPERIMENTAL_ENV = "AIPROF_EXPERIMENTAL_CAUSES"


def experimental_asked() -> frozenset[str]:
    """The experimental codes named in $AIPROF_EXPERIMENTAL_CAUSES (read where the job is
    diagnosed, and passed to where its ranks are)."""
    return frozenset(c.strip() for c in os.environ.get(EXPERIMENTAL_ENV, "").split(",") if c.strip())


def detectors(scope: Scope | tuple[Scope, ...], asked: frozenset[str] | None = None) -> tuple[Detector, ...]:
    """The detectors of ``scope`` (one, or several together) to run, in registry order: the
    validated ones and the experimental ones ``asked`` for (default: $AIPROF_EXPERIMENTAL_CAUSES)."""
    asked = experimental_asked() if asked is None else asked
    scopes = scope if isinstance(scope, tuple) else (scope,)
    return tuple(d for d in REGISTRY if d.scope in scopes and (not d.experimental or d.code in asked))
