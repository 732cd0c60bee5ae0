"""Every lab's instructor notebook (solutions in place) passes its own tests at the CPU sizes.

By default the test cells run with the cells they depend on (``cell_slice``): the ungraded
experiments at their quick sizes are what the demo class's nbgrader run of each reference
executes, and ``test_reference_notebook_records_are_clean`` reads. ``FASTDL_QUICK=0`` in the
environment runs the whole notebook, top to bottom, at full size.
"""

import os

import nbformat
import pytest
from cell_slice import needed_cells
from nbclient import NotebookClient

from autograder.course import CELL_TIMEOUT_S, lab_sources, to_nbgrader_notebook
from autograder.feedback import is_test_cell
from fastdl_lab.device import QUICK_VAR, quick

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("lab", sorted(lab_sources()))
def test_source_notebook_passes_its_tests(lab, tmp_path, monkeypatch):
    monkeypatch.setenv(QUICK_VAR, os.environ.get(QUICK_VAR, "1"))  # the kernel inherits it
    nb = to_nbgrader_notebook(lab_sources()[lab])
    tests = sum(is_test_cell(cell) for cell in nb.cells)
    if quick():
        kept = set(needed_cells(nb))
        nb.cells = [cell for i, cell in enumerate(nb.cells) if cell.cell_type != "code" or i in kept]
    assert sum(is_test_cell(cell) for cell in nb.cells) == tests > 0
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")


def test_the_slice_keeps_what_a_test_reads_and_leaves_out_the_rest():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import torch\nscale = 2"),
        nbformat.v4.new_code_cell("for i in range(3):\n    print(torch.ones(i) * scale)"),  # an experiment
        nbformat.v4.new_code_cell("table = {}\nunused = 1"),
        nbformat.v4.new_code_cell("table['x'] = scale"),  # changes table in place
        nbformat.v4.new_code_cell("def check(i):\n    return table[i]"),
        nbformat.v4.new_code_cell("%time ok = 1"),  # not Python: kept
    ])
    test = nbformat.v4.new_code_cell("for i in 'x':\n    assert check(i) == 2")
    test.metadata["nbgrader"] = {"grade": True, "solution": False, "grade_id": "t", "points": 1}
    nb.cells.append(test)
    assert needed_cells(nb) == [0, 2, 3, 4, 5, 6]


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
