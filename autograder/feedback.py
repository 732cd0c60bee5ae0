"""Feedback that shows the trusted verdict of every item, and nothing of the hidden tests.

nbgrader's feedback renders the autograded notebook, whose test cells hold no verdict: nbgrader's
run leaves them unrun, with a note (``autograder.execute``), and a notebook autograded before that
holds the student's own run of the tests, which may quote hidden test lines in tracebacks. This
preprocessor replaces every test cell's outputs with the engine's verdict for that item.
"""

from __future__ import annotations

import json
from pathlib import Path

from nbconvert.preprocessors import Preprocessor
from nbformat.v4 import new_output
from nbgrader.preprocessors import ClearHiddenTests
from traitlets import Bool, Unicode

from autograder.records import clean_reason


def is_test_cell(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def verdict_text(result: dict) -> str:
    if not result.get("counted", True):
        head = f"not graded on this hardware ({result['max_score']:g} points left out of the total)"
    else:
        head = f"{result['score']:g} / {result['max_score']:g} points"
    return f"Autograder verdict for '{result['item']}': {head} [{result['status']}]\n{clean_reason(result['reason'])}\n"


class ClearHiddenTestsInTestCells(ClearHiddenTests):
    """nbgrader's hidden-test removal, applied to test cells only.

    nbgrader looks for the markers in every cell, so a student who types one in their own cell
    loses lines of their code from the feedback, or all of it when the region never closes. Hidden
    tests live only in test cells, whose source the autograded notebook takes from the instructor's.
    """

    def preprocess_cell(self, cell, resources, cell_index):
        if is_test_cell(cell):
            return super().preprocess_cell(cell, resources, cell_index)
        return cell, resources


class TrustedVerdicts(Preprocessor):
    # nbconvert preprocessors are off unless enabled; this one must always run.
    enabled = Bool(True).tag(config=True)
    records_dir = Unicode("", help="folder of the grading records written by `autograder autograde`").tag(config=True)

    def preprocess(self, nb, resources):
        info = resources.get("nbgrader", {})
        path = Path(self.records_dir) / info.get("assignment", "") / f"{info.get('student', '')}.json"
        results = {}
        if path.exists():
            results = {r["item"]: r for r in json.loads(path.read_text())["items"]}
        for cell in nb.cells:
            if not is_test_cell(cell):
                continue
            result = results.get(cell.metadata["nbgrader"].get("grade_id"))
            text = verdict_text(result) if result else "This item has no verdict from the autograder.\n"
            cell.outputs = [new_output("stream", name="stdout", text=text)]
            cell.execution_count = None
        return nb, resources
