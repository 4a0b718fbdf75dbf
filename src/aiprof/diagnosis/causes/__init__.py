"""Cause detectors, one module per mechanism (docs/findings.md lists them).

Each module has ``CODE`` and ``detect(facts) -> list[Cause]``: evidence from the shared facts,
the place, a specific remedy, and the fix as an :class:`~aiprof.diagnosis.replay.Edit` that the
engine prices by replay. Order matters once: the generic LAUNCH_BOUND runs last and leaves out
the host regions the specific detectors before it claimed.
"""
from aiprof.diagnosis.causes import (
    allocator_churn,
    comm_overlap,
    dataloader,
    decode_launch_bound,
    host_preprocessing,
    host_sampling,
    host_scheduling,
    host_sync,
    idle_sms,
    kv_cache_copy,
    launch_bound,
    matmul_precision,
    new_shapes,
    pageable_copy,
    prefill_stall,
    small_batch,
    syscall_blocked,
    unfused_optimizer,
)

# The serving detectors (host_sampling .. small_batch) act only on inference traces of a language
# model (analysis/serving.py); decode_launch_bound claims the decode iterations' launches, so it
# runs before the generic launch_bound, which prices what is left.
RANK_DETECTORS = (allocator_churn, new_shapes, unfused_optimizer, host_sync, pageable_copy, syscall_blocked, dataloader,
                  host_preprocessing, host_sampling, host_scheduling, kv_cache_copy, prefill_stall, small_batch,
                  matmul_precision, idle_sms, decode_launch_bound, launch_bound)
# Detectors whose remedy would also hide the specific causes' symptoms: priced after those.
GENERIC = (launch_bound,)
# Job-level detectors, ``detect_job(facts, pricer, columns)``: run when collectives couple the ranks.
JOB_DETECTORS: tuple = ()
# Detectors that failed their own validation pair, run only when named in $AIPROF_EXPERIMENTAL_CAUSES
# (comma-separated codes). EXPOSED_BUCKET_COMM: on two NVLink H200s, one 384 MB bucket vs DDP's
# 25 MB buckets measured 0.8 % apart, and it predicted 14.2 % (docs/findings.md, Validation).
EXPERIMENTAL_JOB_DETECTORS = (comm_overlap,)
EXPERIMENTAL_ENV = "AIPROF_EXPERIMENTAL_CAUSES"


def job_detectors() -> tuple:
    """The job-level detectors to run: the validated ones, and the experimental ones asked for."""
    import os

    asked = {c.strip() for c in os.environ.get(EXPERIMENTAL_ENV, "").split(",") if c.strip()}
    return JOB_DETECTORS + tuple(d for d in EXPERIMENTAL_JOB_DETECTORS if d.CODE in asked)
