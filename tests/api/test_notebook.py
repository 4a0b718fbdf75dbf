"""docs/examples/api.ipynb, executed by a real IPython kernel (nbclient + ipykernel) on a copy of
its trace: every cell runs, and the report's cell shows the causes table (text/html)."""
from __future__ import annotations

import os

import nbclient
import nbformat

from tests.api.conftest import ROOT

NOTEBOOK = ROOT / "docs" / "examples" / "api.ipynb"


def _html(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.get("outputs", []))


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, c.source


def test_notebook_runs_and_shows_the_causes_table(gpt2_stall, tmp_path, monkeypatch, pd):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = f"TRACE = {str(gpt2_stall)!r}"
    nb.cells.append(nbformat.v4.new_code_cell("import aiprof; print(aiprof.__file__)"))
    # the kernel inherits this environment: it must import this checkout's aiprof
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("AIPROF_PROGRESS", "never")
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert nb.cells[-1].outputs[0]["text"].strip() == str(ROOT / "src" / "aiprof" / "__init__.py")
    report_cell = next(c for c in nb.cells if c.cell_type == "code" and "cap.report()" in c.source)
    html = _html(report_cell)
    assert '<table class="aiprof-causes">' in html
    assert "DATALOADER_STARVED" in html and "gpt_train.py(22): get_batch" in html
    # the DataFrames render as tables too
    assert "idle_category" in _html(nb.cells[-2]) and "compute_pctg" in _html(nb.cells[-3])
