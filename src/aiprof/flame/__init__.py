"""AI flame graphs: Python → torch op → CUDA call → GPU kernel stacks, and their renderers.

``stacks.build(capture, what="gpu"|"cpu", rank=None, step=None)`` returns a
:class:`~aiprof.flame.profile.Profile`; ``folded``, ``svg`` and ``speedscope`` render it.
See docs/flame.md.
"""
