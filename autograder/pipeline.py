"""The instructor's commands: autograde a lab for every student, make feedback, export a report.

For each student, nbgrader autogrades the notebook (its record of the student's own test run,
for formgrader), then the trusted engine grades every item from the submitted file and its score
is written over nbgrader's. A failure for one student is recorded and the batch goes on.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from autograder import gradebook, notebook, records
from autograder.course import Course
from autograder.engine import bwrap, kernel_jail
from autograder.engine.grade import grade_submission, student_seed
from autograder.engine.items import LabSpec
from autograder.engine.sandbox import Limits, run_sandboxed

REPORT_COLUMNS = ("student", "lab", "item", "score", "max_score", "status", "reason")


@dataclass
class LabSummary:
    lab: str
    students: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "student: what went wrong" (not the grade)
    seconds: dict[str, float] = field(default_factory=dict)  # per student: nbgrader plus engine


# nbgrader executes the student's notebook in a kernel of its own, which starts in the sandbox
# (kernel_jail). nbgrader itself runs under these limits in a private network namespace, which
# the kernel shares (loopback stays up between them): a fork bomb, a memory hog or a process
# left behind in the notebook cannot outlive the run or reach the network.
NBGRADER_LIMITS = Limits(wall_s=1800, cpu_s=3600, memory_bytes=12 << 30, limit_address_space=False,
                         max_processes=48, output_bytes=4 << 20, loopback=True)


def _nbgrader_env(course: Course, profile: dict, isolated: bool) -> dict[str, str]:
    env = dict(os.environ)
    env[kernel_jail.STUDENT_PACKAGE_VAR] = str(course.student_package)
    # nbgrader's run is the student's own test record, not the grade: the notebook's ungraded
    # experiments need only run, at tiny sizes (fastdl_lab.device.quick). FASTDL_QUICK=0 in the
    # instructor's environment keeps them full size.
    env.setdefault(kernel_jail.QUICK_VAR, "1")
    env[kernel_jail.GPU_VAR] = "1" if profile.get("gpu") else "0"
    if not isolated:
        env[kernel_jail.UNSAFE_VAR] = "1"
    return env


def _nbgrader_autograde(course: Course, lab: str, student: str, cell_timeout: int | None, env: dict) -> dict:
    argv = [sys.executable, "-m", "nbgrader", "autograde", lab, "--student", student, "--force"]
    if cell_timeout:
        argv.append(f"--Execute.timeout={cell_timeout}")
    done = run_sandboxed(argv, limits=NBGRADER_LIMITS, cwd=str(course.root), env=env)
    message = ""
    if done.status not in ("ok", "error"):
        message = f"nbgrader autograde was stopped: {done.reason}"
    elif done.returncode != 0:
        lines = [ln for ln in done.output_tail.splitlines() if "ERROR" in ln or "Error" in ln]
        message = "nbgrader could not execute the notebook: " + (" | ".join(lines[-3:]) or f"exit code {done.returncode}")
    return {"returncode": done.returncode, "message": message[:2000]}


def autograde(course: Course, lab: LabSpec, *, profile: dict, seed: int,
              students: list[str] | None = None, cell_timeout: int | None = None,
              isolated: bool = True) -> LabSummary:
    """Grade ``lab`` for every student. ``isolated=False`` (``--unsafe-no-isolation``) runs student
    code without the sandbox and says so in every reason; otherwise a machine that cannot isolate
    raises ``bwrap.IsolationUnavailable`` before anything is graded."""
    if isolated:
        bwrap.check()
    env = _nbgrader_env(course, profile, isolated)
    summary = LabSummary(lab.name)
    for student in students or course.students(lab.name):
        summary.students.append(student)
        started = time.monotonic()
        try:
            # nbgrader follows links and reads any size: a submission the engine refuses never
            # reaches it (a link to another student's notebook would be graded as this one's).
            notebook.read_notebook(course.submitted(student, lab.name))
            nb_run = _nbgrader_autograde(course, lab.name, student, cell_timeout, env)
            nb_run["outputs_cut"] = notebook.cap_outputs(course.autograded(student, lab.name))
        except notebook.NotebookError as exc:
            nb_run = {"returncode": None, "message": records.clean_reason(f"not given to nbgrader: {exc}")}
        nb_run["seconds"] = round(time.monotonic() - started, 2)
        if nb_run["message"]:
            summary.failures.append(f"{student}: {nb_run['message']}")
        results = grade_submission(
            lab, course.submitted(student, lab.name), release=course.release(lab.name), profile=profile,
            seed=student_seed(seed, lab.name, student), student_package=course.student_package, isolated=isolated,
        )
        items = [r.as_dict() for r in results]
        summary.seconds[student] = round(time.monotonic() - started, 1)
        records.write(course.records, lab.name, student, profile=profile["name"], seed=seed, items=items, nbgrader=nb_run)
        try:
            gradebook.write_scores(course.db_url, lab, student, items)
        except Exception as exc:  # noqa: BLE001 - the record and report still hold the verdicts
            summary.failures.append(f"{student}: gradebook not updated: {exc}")
    return summary


def feedback(course: Course, lab: LabSpec, students: list[str] | None = None) -> list[str]:
    """HTML feedback per student; returns the failures."""
    failures = []
    for student in students or course.students(lab.name):
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
        done = course.nbgrader("generate_feedback", lab.name, "--student", student, "--force")
        if done.returncode != 0:
            failures.append(f"{student}: nbgrader generate_feedback failed: {done.stderr[-500:]}")
    return failures


def report_rows(course: Course) -> list[dict]:
    rows = []
    for record in records.read_all(course.records):
        for item in record["items"]:
            rows.append({
                "student": record["student"], "lab": record["lab"], "item": item["item"],
                "score": item["score"], "max_score": item["max_score"],
                # Records written before reasons were capped may still hold any text.
                "status": item["status"], "reason": records.clean_reason(item["reason"]),
            })
    return rows


def write_report(course: Course, csv_path: Path) -> tuple[Path, Path]:
    """The CSV (one row per student, lab and item) and, beside it, the full grading records."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    # A student folder's name is whatever bytes the file system allows: never let one stop the report.
    with csv_path.open("w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        writer = csv.DictWriter(f, fieldnames=REPORT_COLUMNS)
        writer.writeheader()
        writer.writerows(report_rows(course))
    record_path = csv_path.with_suffix(".records.json")
    record_path.write_text(json.dumps(records.read_all(course.records), indent=2))
    return csv_path, record_path


def totals(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per student and lab: counted score and max, and the points left out for needing a GPU."""
    out: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = out.setdefault((row["student"], row["lab"]), {"score": 0.0, "max": 0.0, "left_out": 0.0})
        if row["status"] == "needs_gpu":
            entry["left_out"] += float(row["max_score"])
        else:
            entry["score"] += float(row["score"])
            entry["max"] += float(row["max_score"])
    return out
