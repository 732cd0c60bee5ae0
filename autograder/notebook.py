"""Reading a submitted notebook without executing it: graded cells by grade_id, and tampering.

A submission is compared with the release the student was given: a test cell that is missing or
whose source differs from the release costs its item, with the reason named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

UNANSWERED = "raise NotImplementedError()"


class NotebookError(Exception):
    """The file is not a notebook the grader can read; the message says why."""


@dataclass
class GradedCells:
    solutions: dict[str, str]  # grade_id -> source
    tests: dict[str, str]


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def graded_cells(nb: dict) -> GradedCells:
    solutions, tests = {}, {}
    for cell in nb.get("cells", []):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        grade_id = meta.get("grade_id")
        if not isinstance(grade_id, str):
            continue
        if meta.get("solution"):
            solutions[grade_id] = _source(cell)
        elif meta.get("grade"):
            tests[grade_id] = _source(cell)
    return GradedCells(solutions, tests)


def read_notebook(path: Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotebookError(f"notebook cannot be read: {exc}") from exc
    try:
        nb = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookError(f"notebook is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotebookError("notebook has no list of cells (not an .ipynb file?)")
    return nb


def _normalise(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def test_cell_problem(test_id: str, submitted: GradedCells, released: GradedCells) -> str | None:
    """Why the item's test cell disqualifies it, or None when it is as released."""
    if test_id not in submitted.tests:
        return f"test cell '{test_id}' was deleted"
    if _normalise(submitted.tests[test_id]) != _normalise(released.tests.get(test_id, "")):
        return f"test cell '{test_id}' was edited (test cells are locked)"
    return None


def solution_problem(cell_ids: tuple[str, ...], submitted: GradedCells, released: GradedCells) -> str | None:
    """Why the item cannot be graded from its solution cells, or None."""
    missing = [c for c in cell_ids if c not in submitted.solutions]
    if missing:
        return f"solution cell '{missing[0]}' is missing"
    untouched = [
        c for c in cell_ids
        if UNANSWERED in submitted.solutions[c] and _normalise(submitted.solutions[c]) == _normalise(released.solutions.get(c, ""))
    ]
    if untouched:
        return f"not attempted: solution cell '{untouched[0]}' is as released"
    return None
