"""Making submissions from the release: the demo students and the adversarial fixtures.

A submission is the release notebook with some solution cells filled in, exactly what a student
hands in. ``reference`` fills every cell with the instructor's solution; ``untouched`` is the
release as handed out; a cells file (``# %% grade_id=<id>`` headers followed by code) replaces
the named cells and keeps the reference for the others, so each demo or fixture shows one mistake.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

from autograder.course import Course
from autograder.strip import BEGIN, END

DEMO_DIR = Path(__file__).resolve().parent / "demo"
FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"
HEADER = re.compile(r"^# %% grade_id=(\S+)\s*$")


def parse_cells_file(path: Path) -> dict[str, str]:
    cells: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines(keepends=True):
        match = HEADER.match(line)
        if match:
            current = match.group(1)
            cells[current] = []
        elif current is not None:
            cells[current].append(line)
    if not cells:
        raise ValueError(f"{path}: no '# %% grade_id=<id>' cell headers")
    return {k: "".join(v).strip() + "\n" for k, v in cells.items()}


def reference_solutions(course: Course, lab: str) -> dict[str, str]:
    """The instructor's solution cells with the region markers removed, as a student would write them."""
    nb = nbformat.read(course.source(lab), as_version=4)
    solutions = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("solution"):
            lines = [ln for ln in cell.source.splitlines() if ln.strip() not in (BEGIN, END)]
            solutions[meta["grade_id"]] = "\n".join(lines)
    return solutions


def make_submission(course: Course, lab: str, student: str, cells: dict[str, str] | None) -> Path:
    """Write ``student``'s submission: the release with ``cells`` (grade_id -> source) filled in."""
    nb = nbformat.read(course.release(lab), as_version=4)
    known = set()
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cells and grade_id in cells:
            cell.source = cells[grade_id]
            known.add(grade_id)
    unknown = set(cells or ()) - known
    if unknown:
        raise ValueError(f"{lab}: no solution cells named {sorted(unknown)}")
    target = course.submitted(student, lab)
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return target


def variant(course: Course, lab: str, student: str, cells_file: Path) -> Path:
    """A submission equal to the reference except for the cells in ``cells_file``."""
    return make_submission(course, lab, student, {**reference_solutions(course, lab), **parse_cells_file(cells_file)})


def demo_students(course: Course, lab: str) -> list[str]:
    """Write the demo submissions of ``lab``; returns the student names."""
    make_submission(course, lab, "reference", reference_solutions(course, lab))
    make_submission(course, lab, "untouched", None)
    students = ["reference", "untouched"]
    for path in sorted((DEMO_DIR / lab).glob("buggy-*.py")):
        variant(course, lab, path.stem, path)
        students.append(path.stem)
    return students


def demo_targets(lab: str, student: str) -> list[str] | None:
    """The items a buggy demo's mistake can reach: those executing a cell it replaces, or whose test
    cell it replaces. None for a submission that is not a buggy demo (every item counts)."""
    from autograder.engine.items import load_lab

    path = DEMO_DIR / lab / f"{student}.py"
    if not student.startswith("buggy-") or not path.is_file():
        return None
    replaced = set(parse_cells_file(path))
    return [item.name for item in load_lab(lab).items if replaced & {*item.cells, item.name}]
