"""aiprof: find out why a PyTorch job on NVIDIA GPUs is slow, stuck or wasteful.

The library is usable without the CLI (docs/api.md)::

    import aiprof

    cap = aiprof.open("trace.json.gz")       # or a list of files / folders, one trace per rank
    kernels = cap.kernels.to_pandas()        # or .to_arrow()
    report = cap.report()                    # typed; report.to_dict() is the JSON report
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # aiprof.open is imported on first use: the agent imports this package inside the user's
    # job, which must not pay for numpy, pyarrow and the analysis
    if name == "open":
        from aiprof.api import open as api_open

        return api_open
    raise AttributeError(f"module 'aiprof' has no attribute {name!r}")
