"""nbgrader's run of a submission: every cell but the test cells, whose items the engine grades.

``nbgrader autograde`` executes the whole notebook, test cells included, and scores each test cell
by whether it raised. Here that score never counts: every test cell is one item of the lab's
``LabSpec`` (same grade_id), which the trusted engine grades from the submitted file and writes
over nbgrader's score. Re-running the tests in the student's kernel repeats that work on the
visible inputs (lab 09's test builds the student's C++ a second time), so nbgrader's run executes
everything else, for the record formgrader shows, and leaves each test cell a note instead.

nbgrader's own scoring of a test cell (``utils.determine_grade``: full marks without error output,
partial credit for a float as the cell's result) never runs either: ``SaveGradesOfOtherCells``
leaves test cells to the engine, so nothing the student's process prints or returns can become a
score. Until the engine's verdict is in the gradebook the item has no score.
"""

from __future__ import annotations

from nbformat.v4 import new_output
from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute, SaveAutoGrades
from traitlets import Bool

from autograder.feedback import is_test_cell

NOT_RUN = ("Not run in this execution of your notebook: the autograder grades this item itself, "
           "with inputs of its own, in a sandbox of its own. Its verdict is in your feedback.\n")


AS_RELEASED = ("Not run: every code cell of this notebook is the release's as handed out, so nothing in it "
               "is yours to run. Each graded item says 'not attempted' in your feedback.\n")


class ExecuteUngradedCells(Execute):
    """nbgrader's Execute (the course's kernel manager, timeout and error settings apply as they
    are), which runs every cell except the test cells.

    A notebook whose code cells are all the release's (``as_released``, set by the grading job
    that compared them) runs nothing: its record would only be the course's own cells run again,
    seconds of a kernel per submission, and every item of it is already "not attempted"."""

    as_released = Bool(False, help="every code cell is the release's: execute nothing").tag(config=True)

    def preprocess(self, nb, resources, km=None):
        if not self.as_released:
            return super().preprocess(nb, resources, km=km)
        first = next((cell for cell in nb.cells if cell.cell_type == "code"), None)
        if first is not None:
            first.outputs = [new_output("stream", name="stderr", text=AS_RELEASED)]
        return nb, resources

    def preprocess_cell(self, cell, resources, index):
        if is_test_cell(cell):
            cell.outputs = [new_output("stream", name="stderr", text=NOT_RUN)]
            cell.execution_count = None
            return cell, resources
        return super().preprocess_cell(cell, resources, index)


class SaveGradesOfOtherCells(SaveAutoGrades):
    """nbgrader's SaveAutoGrades for every graded cell except the test cells, whose items the engine
    scores: their grades are left as they are (empty in nbgrader's scratch run)."""

    def preprocess_cell(self, cell, resources, cell_index):
        if is_test_cell(cell):
            return cell, resources
        return super().preprocess_cell(cell, resources, cell_index)


def autograde_preprocessors(execute=ExecuteUngradedCells, save=SaveGradesOfOtherCells) -> list:
    """nbgrader's own autograde steps with its Execute and SaveAutoGrades replaced (``None`` drops
    the step), for ``c.Autograde.autograde_preprocessors``."""
    steps = list(Autograde.class_traits()["autograde_preprocessors"].default())
    for step in (Execute, SaveAutoGrades):
        if step not in steps:
            raise RuntimeError(f"this nbgrader's autograde has no {step.__name__} step to replace")
    replaced = {Execute: execute, SaveAutoGrades: save}
    return [replaced.get(step, step) for step in steps if replaced.get(step, step) is not None]
