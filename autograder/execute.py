"""nbgrader's run of a submission: every cell but the test cells, whose items the engine grades.

``nbgrader autograde`` executes the whole notebook, test cells included, and scores each test cell
by whether it raised. Here that score never counts: every test cell is one item of the lab's
``LabSpec`` (same grade_id), which the trusted engine grades from the submitted file and writes
over nbgrader's score. Re-running the tests in the student's kernel repeats that work on the
visible inputs (lab 09's test builds the student's C++ a second time), so nbgrader's run executes
everything else, for the record formgrader shows, and leaves each test cell a note instead.

The note is written to stderr on purpose: nbgrader scores a test cell with stderr output as zero,
so until the engine's verdict is in the gradebook the item counts nothing, as an unrun test should.
"""

from __future__ import annotations

from nbformat.v4 import new_output
from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute

from autograder.feedback import is_test_cell

NOT_RUN = ("Not run in this execution of your notebook: the autograder grades this item itself, "
           "with inputs of its own, in a sandbox of its own. Its verdict is in your feedback.\n")


class ExecuteUngradedCells(Execute):
    """nbgrader's Execute (the course's kernel manager, timeout and error settings apply as they
    are), which runs every cell except the test cells."""

    def preprocess_cell(self, cell, resources, index):
        if is_test_cell(cell):
            cell.outputs = [new_output("stream", name="stderr", text=NOT_RUN)]
            cell.execution_count = None
            return cell, resources
        return super().preprocess_cell(cell, resources, index)


def autograde_preprocessors() -> list:
    """nbgrader's own autograde steps with its Execute replaced, for ``c.Autograde.autograde_preprocessors``."""
    steps = list(Autograde.class_traits()["autograde_preprocessors"].default())
    if Execute not in steps:
        raise RuntimeError("this nbgrader's autograde has no Execute step to replace")
    return [ExecuteUngradedCells if step is Execute else step for step in steps]
