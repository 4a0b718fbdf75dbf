"""One definition of 'a call that blocks the host until the GPU catches up'."""
from __future__ import annotations

import pytest

from aiprof.trace.classify import is_sync_call


@pytest.mark.parametrize("name", ["cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                                  "cuStreamSynchronize", "cuCtxSynchronize", "cudaMemcpy", "cuMemcpyDtoH_v2",
                                  "cuMemcpyHtoD_v2", "cudaMemcpy2D"])
def test_blocking_calls(name):
    assert is_sync_call(name)


@pytest.mark.parametrize("name", ["cudaStreamWaitEvent", "cudaStreamQuery", "cudaMemcpyAsync", "cudaLaunchKernel",
                                  "cuLaunchKernelEx", "cudaEventRecord"])
def test_calls_that_return_at_once(name):
    assert not is_sync_call(name)
