"""The in-process agent: iteration hooks, torch.profiler driver, hardware sampler, control channel.

It runs inside someone else's training job, so every module here imports only the standard
library at import time (torch, psutil and pynvml are imported lazily, once torch is already
loaded by the job) and every entry point from the job's threads catches all exceptions.

Entry points: :func:`aiprof.agent.bootstrap.start_from_env` (``aiprof run``'s preload hook) and
:func:`aiprof.agent.bootstrap.start_attached` (``aiprof attach``'s injected script).
"""
