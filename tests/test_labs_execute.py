"""Every lab's instructor notebook (solutions in place) runs top to bottom at the CPU sizes.

The ungraded experiments run at their quick sizes (fastdl_lab.device.quick), as in the grader's
nbgrader run; ``FASTDL_QUICK=0`` in the environment runs them full size.
"""

import os

import pytest
from nbclient import NotebookClient

from autograder.course import CELL_TIMEOUT_S, lab_sources, to_nbgrader_notebook
from fastdl_lab.device import QUICK_VAR

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("lab", sorted(lab_sources()))
def test_source_notebook_executes(lab, tmp_path, monkeypatch):
    monkeypatch.setenv(QUICK_VAR, os.environ.get(QUICK_VAR, "1"))  # the kernel inherits it
    nb = to_nbgrader_notebook(lab_sources()[lab])
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []


@pytest.mark.parametrize("lab", sorted(lab_sources()))
def test_graded_cells_carry_complete_nbgrader_metadata(lab):
    nb = to_nbgrader_notebook(lab_sources()[lab])
    graded = [c for c in nb.cells if "nbgrader" in c.metadata]
    assert graded
    for cell in graded:
        meta = cell.metadata["nbgrader"]
        assert {"grade", "grade_id", "locked", "schema_version", "solution", "task"} <= set(meta)
        if meta["grade"]:
            assert meta["points"] > 0 and meta["locked"]
        if meta["solution"]:
            assert "### BEGIN SOLUTION" in cell.source
