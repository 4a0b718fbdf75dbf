"""aiprof: find out why a PyTorch job on NVIDIA GPUs is slow, stuck or wasteful.

The library is usable without the CLI::

    from aiprof.trace.store import open_capture
    from aiprof.pipeline import build_report

    cap = open_capture("trace.json.gz")
    report = build_report(cap)
"""

__version__ = "0.1.0"
