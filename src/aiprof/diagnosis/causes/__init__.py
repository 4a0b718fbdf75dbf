"""Cause detectors, one module per mechanism (docs/diagnosis.md lists them).

Each module has ``CODE`` and ``detect(facts) -> list[Cause]``: evidence from the shared facts,
the place, a specific remedy, and the fix as an :class:`~aiprof.diagnosis.replay.Edit` that the
engine prices by replay. Order matters once: the generic LAUNCH_BOUND runs last and leaves out
the host regions the specific detectors before it claimed.
"""
from aiprof.diagnosis.causes import (
    allocator_churn,
    dataloader,
    host_preprocessing,
    host_sync,
    launch_bound,
    matmul_precision,
    new_shapes,
    pageable_copy,
    unfused_optimizer,
)

RANK_DETECTORS = (allocator_churn, new_shapes, unfused_optimizer, host_sync, pageable_copy, dataloader,
                  host_preprocessing, matmul_precision, launch_bound)
# Detectors whose remedy would also hide the specific causes' symptoms: priced after those.
GENERIC = (launch_bound,)
