"""A class to grade under faults: honest and hostile submissions of lab 00, for the load test.

One in five submissions attacks the grader (a crash, a loop, a fork bomb, a memory hog, an output
flood, broken JSON, a link to another student's notebook, a deleted test cell); the others are the
reference or the reference with one known mistake. ``tests/test_batch.py`` grades a class of 24 on
two workers, one of each hostile kind; ``benchmarks/grading_scale.py --load`` grades 500 on eight.
"""

from __future__ import annotations

import nbformat

from autograder.course import Course
from autograder.submissions import DEMO_DIR, make_submission, parse_cells_file, reference_solutions

LAB = "00_measure"
ITEM = "roofline"  # the one item graded: the load is in the number of jobs, not in their size
# Solution cells that attack the grader.
HOSTILE_CELLS = {
    "crashes": "import os\nos._exit(3)",
    "loops": "while True:\n    pass",
    "forks": "import os\nwhile True:\n    os.fork()",
    "hogs-memory": "blocks = [bytearray(1 << 30) for _ in range(64)]",
    "floods": "print('x' * (64 << 20))",
}
HOSTILE = [*HOSTILE_CELLS, "not-json", "links-to-another", "deletes-test"]
# What an honest submission scores on ITEM: the reference, or every fourth with the demo's FLOP mistake.
FULL, BUGGY = (4.0, "passed"), (3.2, "partial")


def honest_name(i: int) -> str:
    return f"honest-{i:04d}"


def expected(student: str) -> tuple[float, str] | None:
    """The score and status an honest submission must get; None for a hostile one."""
    if not student.startswith("honest-"):
        return None
    return BUGGY if int(student.split("-")[1]) % 4 == 3 else FULL


def _hostile(course: Course, name: str, tag: str, victim: str) -> str:
    student = f"{name}-{tag}"
    if name in HOSTILE_CELLS:
        make_submission(course, LAB, student, {**reference_solutions(course, LAB), "roofline_code": HOSTILE_CELLS[name]})
    elif name == "not-json":
        path = course.submitted(student, LAB)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"cells": [')
    elif name == "links-to-another":
        path = course.submitted(student, LAB)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(course.submitted(victim, LAB))
    else:
        target = make_submission(course, LAB, student, reference_solutions(course, LAB))
        nb = nbformat.read(target, as_version=4)
        nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != ITEM]
        nbformat.write(nb, target)
    return student


def make_class(course: Course, size: int, hostile: int | None = None) -> list[str]:
    """Write ``size`` submissions, ``hostile`` of them (default a fifth) cycling through HOSTILE;
    returns the students."""
    hostile = size // 5 if hostile is None else hostile
    buggy = parse_cells_file(DEMO_DIR / LAB / "buggy-flops.py")
    students = []
    for i in range(size - hostile):
        cells = reference_solutions(course, LAB)
        if expected(honest_name(i)) == BUGGY:
            cells |= buggy
        make_submission(course, LAB, honest_name(i), cells)
        students.append(honest_name(i))
    for j in range(hostile):
        students.append(_hostile(course, HOSTILE[j % len(HOSTILE)], f"{j:04d}", victim=students[0]))
    return students
