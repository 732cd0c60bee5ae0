"""Feedback that shows the trusted verdict of every item, and nothing of the hidden tests.

nbgrader's feedback renders the autograded notebook, whose test-cell outputs are the student's own
run of the tests: they may quote hidden test lines in tracebacks, and they are not the grade. This
preprocessor replaces every test cell's outputs with the engine's verdict for that item.
"""

from __future__ import annotations

import json
from pathlib import Path

from nbconvert.preprocessors import Preprocessor
from nbformat.v4 import new_output
from traitlets import Bool, Unicode

from autograder.records import clean_reason


def verdict_text(result: dict) -> str:
    if not result.get("counted", True):
        head = f"not graded on this hardware ({result['max_score']:g} points left out of the total)"
    else:
        head = f"{result['score']:g} / {result['max_score']:g} points"
    return f"Autograder verdict for '{result['item']}': {head} [{result['status']}]\n{clean_reason(result['reason'])}\n"


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
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
                continue
            result = results.get(meta.get("grade_id"))
            text = verdict_text(result) if result else "This item has no verdict from the autograder.\n"
            cell.outputs = [new_output("stream", name="stdout", text=text)]
            cell.execution_count = None
        return nb, resources
