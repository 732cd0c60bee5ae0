"""The instructor's commands: autograde a lab for every student, make feedback, export a report.

For each student, nbgrader runs the notebook but its test cells (the executed notebook is the
record formgrader and the feedback show), then the trusted engine grades every item from the
submitted file and its score is written over nbgrader's (``jobs.py`` grades one submission, ``batch.py`` many, in parallel).
A failure for one student is recorded and the batch goes on.
"""

from __future__ import annotations

import csv
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from autograder import batch, gradebook, notebook, records
from autograder.course import Course
from autograder.engine.items import LabSpec

REPORT_COLUMNS = ("student", "lab", "item", "score", "max_score", "counted", "status", "reason")
# After each student's items of a lab, the CSV has a row with their total: the sum of the rows
# counted "yes", which is the total nbgrader's export and the CLI give.
TOTAL_ITEM, TOTAL_STATUS = "(total)", "total"


@dataclass
class LabSummary:
    lab: str
    students: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "student: what went wrong" (not the grade)
    seconds: dict[str, float] = field(default_factory=dict)  # per student: wall time (nbgrader beside the engine)


def autograde(course: Course, lab: LabSpec, *, profile: dict, seed: int,
              students: list[str] | None = None, cell_timeout: int | None = None,
              isolated: bool = True, workers: int = 1, scheduler: str | None = None,
              execute: bool = True) -> LabSummary:
    """Grade ``lab`` for every student (``batch.grade`` does the work, and says what the options do)."""
    jobs = [(lab.name, student) for student in students or course.students(lab.name)]
    done = batch.grade(course, jobs, profile=profile, seed=seed, workers=workers, scheduler=scheduler,
                       cell_timeout=cell_timeout, isolated=isolated, execute=execute)
    return lab_summary(lab.name, done)


def lab_summary(lab: str, done: batch.BatchSummary) -> LabSummary:
    prefix = f"{lab} "
    return LabSummary(
        lab, students=[s for (name, s) in done.jobs if name == lab],
        failures=[f[len(prefix):] for f in done.failures if f.startswith(prefix)],
        seconds={s: round(t, 1) for (name, s), t in done.seconds.items() if name == lab},
    )


def feedback(course: Course, lab: LabSpec, students: list[str] | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> list[str]:
    """HTML feedback per student; returns the failures. ``progress(done, total, line)`` follows it.

    Raises ``gradebook.MaximumMismatch``, before anything is written, where the gradebook's maximum
    for ``lab`` is not the one the students' grading records give: nbgrader takes the feedback's
    total from the gradebook, and it would contradict the CLI and the report."""
    failures, ready = [], []
    students = students or course.students(lab.name)
    gradebook.check_maxima(course.db_url, lab, records.read_lab(course.records, lab.name), students)
    for done, student in enumerate(students, 1):
        if progress:
            progress(done, len(students), f"feedback {lab.name} {student}")
        # What nbgrader autograded may have been read through a link to another student's
        # notebook: feedback is made only for a submission the engine itself could read.
        try:
            nb = notebook.read_notebook(course.submitted(student, lab.name))
        except notebook.NotebookError as exc:
            failures.append(f"{student}: no feedback: {records.clean_reason(exc)}")
            continue
        target = course.autograded(student, lab.name)
        if not target.exists():
            # nbgrader could not execute this notebook; feedback starts from the submission.
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(nb))
        try:
            notebook.copy_exchange_notes(course.submitted(student, lab.name).parent, target.parent)
        except notebook.NotebookError as exc:
            failures.append(f"{student}: feedback cannot be released: {records.clean_reason(exc)}")
        ready.append(student)
    return failures + _generate_feedback(course, lab.name, ready)


def _generate_feedback(course: Course, lab: str, students: list[str]) -> list[str]:
    """nbgrader's feedback for ``students`` of ``lab``: one run for all of them (a run's start costs
    more than a notebook's conversion: 7.4 s for a lab's 7 students against 23.6 s in 7 runs on the
    2-core machine), leaving out by name everyone else nbgrader would find. Where that run fails,
    or a name cannot be listed, one run per student, so that a failure names its student."""
    if not students:
        return []
    autograded = course.root / "autograded"
    others = sorted(p.name for p in autograded.iterdir() if p.name not in students) if autograded.exists() else []
    # nbgrader reads the exclusions as one comma-separated list, and a name is a glob to it.
    listable = not any(set(",*?[]") & set(name) for name in [*students, *others])
    if listable and len(students) > 1:
        started = time.time()
        done = course.nbgrader("generate_feedback", lab, "--force",
                               f"--CourseDirectory.student_id_exclude={','.join(others)}")
        if done.returncode == 0 and all(_written_since(course.feedback_dir(s, lab), started) for s in students):
            return []
    failures = []
    for student in students:
        done = course.nbgrader("generate_feedback", lab, "--student", student, "--force")
        if done.returncode != 0:
            failures.append(f"{student}: nbgrader generate_feedback failed: {done.stderr[-500:]}")
    return failures


def _written_since(folder: Path, started: float) -> bool:
    """Whether nbgrader wrote a page into ``folder`` in this run (a page an earlier run left there is
    not this run's feedback)."""
    pages = list(folder.glob("*.html")) if folder.is_dir() else []
    return bool(pages) and all(page.stat().st_mtime >= started - 1 for page in pages)


def report_rows(course: Course) -> list[dict]:
    rows = []
    for record in records.read_all(course.records):
        for item in record["items"]:
            rows.append({
                "student": record["student"], "lab": record["lab"], "item": item["item"],
                "score": item["score"], "max_score": item["max_score"],
                # False: left out of the total on this profile (a speed item without a GPU).
                "counted": bool(item.get("counted", True)),
                # Records written before reasons were capped may still hold any text.
                "status": item["status"], "reason": records.clean_reason(item["reason"]),
            })
    return rows


def csv_rows(rows: list[dict]) -> list[dict]:
    """``rows`` (``report_rows``) as the CSV writes them: ``counted`` as yes or no, and after each
    student's items of a lab a total row (item "(total)", status "total", ``counted`` empty)."""
    sums = totals(rows)
    out = []
    for key, group in itertools.groupby(rows, key=lambda row: (row["student"], row["lab"])):
        out += [{**row, "counted": "yes" if row["counted"] else "no"} for row in group]
        total = sums[key]
        out.append({"student": key[0], "lab": key[1], "item": TOTAL_ITEM, "score": total["score"],
                    "max_score": total["max"], "counted": "", "status": TOTAL_STATUS,
                    "reason": f"{total['left_out']:g} points need a GPU: left out" if total["left_out"] else ""})
    return out


def write_report(course: Course, csv_path: Path) -> tuple[Path, Path]:
    """The CSV (one row per student, lab and item, then that student's total of the lab) and, beside
    it, the full grading records."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    # A student folder's name is whatever bytes the file system allows: never let one stop the report.
    with csv_path.open("w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        writer = csv.DictWriter(f, fieldnames=REPORT_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(report_rows(course)))
    record_path = csv_path.with_suffix(".records.json")
    record_path.write_text(json.dumps(records.read_all(course.records), indent=2))
    return csv_path, record_path


def totals(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per student and lab: counted score and max, and the points left out for needing a GPU."""
    out: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = out.setdefault((row["student"], row["lab"]), {"score": 0.0, "max": 0.0, "left_out": 0.0})
        if not row.get("counted", row["status"] != "needs_gpu"):
            entry["left_out"] += float(row["max_score"])
        else:
            entry["score"] += float(row["score"])
            entry["max"] += float(row["max_score"])
    return out
