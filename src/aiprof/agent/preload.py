"""The ``sitecustomize`` that ``aiprof run`` puts first on PYTHONPATH of the job it starts.

This file is copied as ``sitecustomize.py`` into a private boot folder next to an ``aiprof``
link to this package. At interpreter start it:

1. runs the ``sitecustomize`` that would have run without us (next one on sys.path), if any;
2. installs a meta-path finder that waits for ``import torch`` and does nothing else. When
   torch has finished importing, it removes itself and starts the agent
   (:func:`aiprof.agent.bootstrap.start_from_env`). A process that never imports torch
   (shell helpers, tokenizers, the compiler) pays one finder lookup per import, nothing more.

It must run on Python 3.10+ with only the standard library, and never raise.
"""
import os
import sys


def _chain_sitecustomize() -> None:
    """Execute the next ``sitecustomize`` on sys.path (the one we shadow)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


class _TorchWatcher:
    """Meta-path finder: on ``import torch``, wrap torch's loader to start the agent after it."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        except Exception:
            return None
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig = loader.exec_module

        def exec_module(module):  # noqa: ANN001
            orig(module)
            _start_agent()

        loader.exec_module = exec_module
        return spec


def _start_agent() -> None:
    try:
        from aiprof.agent.bootstrap import start_from_env

        start_from_env()
    except Exception as exc:  # the agent itself catches everything; this guards the import
        try:
            sys.stderr.write(f"aiprof agent[{os.getpid()}]: not started ({type(exc).__name__}: {exc})\n")
        except Exception:
            pass


def _install() -> None:
    try:
        _chain_sitecustomize()
    except Exception as exc:
        try:
            import traceback

            sys.stderr.write("Error in the job's own sitecustomize (run by aiprof):\n")
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        except Exception:
            pass
    try:
        if os.environ.get("AIPROF_AGENT"):
            if "torch" in sys.modules:
                _start_agent()
            else:
                sys.meta_path.insert(0, _TorchWatcher())
    except Exception:
        pass


_install()
