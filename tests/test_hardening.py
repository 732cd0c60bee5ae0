"""Hostile submissions against the parts of the autograder that read, record and report them."""

import csv
import json
import os
import stat
import subprocess
import threading

import pytest
from nbconvert.filters.markdown import markdown2html
from nbformat.v4 import new_code_cell, new_notebook
from nbgrader.preprocessors import ClearHiddenTests
from traitlets.config import Config

from autograder import cli, gradebook, notebook, pipeline, records
from autograder.course import Course, write_config
from autograder.engine.grade import grade_submission
from autograder.engine.items import Item, LabSpec
from autograder.feedback import verdict_text

LAB = "01_gemm"
SPEC = LabSpec(LAB, [Item("f_test", 2.0, ("f_code",), make_inputs=lambda seed, params: {})])


def cell(grade_id, source, *, solution=False, grade=False, cell_type="code"):
    meta = {"nbgrader": {"grade_id": grade_id, "solution": solution, "grade": grade}}
    return {"cell_type": cell_type, "metadata": meta, "source": source, "outputs": [], "execution_count": None}


def nb(*cells):
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def course(tmp_path):
    """alice has a real submission; the others reach it, or something worse, by other means."""
    course = Course(tmp_path / "course")
    alice = course.submitted("alice", LAB)
    alice.parent.mkdir(parents=True)
    alice.write_text(json.dumps(nb(cell("f_code", "x = 1", solution=True))))
    submitted = course.root / "submitted"
    (submitted / "bob").symlink_to(submitted / "alice")
    (submitted / "carol").mkdir()
    (submitted / "carol" / LAB).symlink_to(alice.parent)
    course.submitted("dave", LAB).parent.mkdir(parents=True)
    course.submitted("dave", LAB).symlink_to(alice)
    course.submitted("erin", LAB).parent.mkdir(parents=True)
    os.mkfifo(course.submitted("erin", LAB))
    return course


def _read_in_thread(path):
    """read_notebook's error or result; a read that blocks (a FIFO) fails the test instead of hanging it."""
    out = {}

    def target():
        try:
            out["nb"] = notebook.read_notebook(path)
        except notebook.NotebookError as exc:
            out["error"] = str(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(5)
    assert out, f"reading {path} blocked"
    return out


@pytest.mark.parametrize("student, words", [
    ("bob", "'bob' is a symbolic link"),
    ("carol", f"'{LAB}' is a symbolic link"),
    ("dave", f"'{LAB}.ipynb' is a symbolic link"),
    ("erin", "is a FIFO"),
])
def test_links_and_special_files_are_refused_by_name(course, student, words):
    assert student in course.students(LAB)
    assert words in _read_in_thread(course.submitted(student, LAB)).get("error", "")
    assert "nb" in _read_in_thread(course.submitted("alice", LAB))


def test_a_device_is_refused(tmp_path):
    path = tmp_path / "nb.ipynb"
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
    except PermissionError:
        pytest.skip("creating a device needs privileges")
    with pytest.raises(notebook.NotebookError, match="is a device"):
        notebook.read_notebook(path)


def test_oversized_and_deeply_nested_notebooks_are_refused(tmp_path):
    big = tmp_path / "big.ipynb"
    with big.open("wb") as f:
        f.truncate(notebook.MAX_NOTEBOOK_BYTES + 1)
    with pytest.raises(notebook.NotebookError, match="larger than 20 MiB"):
        notebook.read_notebook(big)
    deep = tmp_path / "deep.ipynb"
    deep.write_text("[" * 200_000)
    with pytest.raises(notebook.NotebookError, match="nested too deeply"):
        notebook.read_notebook(deep)


def test_a_linked_student_folder_gets_a_named_zero_and_no_feedback(course):
    results = grade_submission(SPEC, course.submitted("bob", LAB), release=course.submitted("alice", LAB),
                               profile={"name": "cpu"}, seed=0, student_package=course.root)
    assert [(r.status, r.score) for r in results] == [("invalid_notebook", 0.0)]
    assert "symbolic link" in results[0].reason
    # feedback refuses before nbgrader runs: no other student's notebook is rendered as bob's
    assert pipeline.feedback(course, SPEC, ["bob"]) == [f"bob: no feedback: {results[0].reason}"]


HOSTILE_REASON = "<script>alert(1)</script> [x](javascript:alert(1)) \x00\x1b[2J\ud800\u202e" + "y" * (20 << 20)


def test_reasons_are_capped_and_cleaned_in_records_and_report(tmp_path):
    course = Course(tmp_path / "course")
    item = {"item": "f_test", "score": 0.0, "max_score": 2.0, "status": "error", "reason": HOSTILE_REASON, "counted": True}
    path = records.write(course.records, LAB, "mallory", profile="cpu", seed=1, items=[item], nbgrader={})
    assert path.stat().st_size < 100_000
    reason = records.read_all(course.records)[0]["items"][0]["reason"]
    assert len(reason) <= records.MAX_REASON_CHARS and "\x00" not in reason and "\x1b" not in reason
    csv_path, _ = pipeline.write_report(course, tmp_path / "report.csv")
    with csv_path.open(newline="") as f:
        (row, total) = csv.DictReader(f)
    assert row["reason"] == reason
    assert total["status"] == pipeline.TOTAL_STATUS
    assert len(verdict_text(item)) < records.MAX_REASON_CHARS + 200


class FakeGradebook:
    """Just what write_scores touches of nbgrader's Gradebook."""

    def __init__(self, db_url):
        self.grade, self.comment = type("Grade", (), {})(), type("Comment", (), {})()
        self.db = type("Db", (), {"commit": lambda self: None})()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update_or_create_student(self, student):
        pass

    def find_submission(self, lab, student):
        pass

    def find_grade(self, *args):
        return self.grade

    def find_comment(self, *args):
        return self.comment

    def find_grade_cell(self, *args):
        return type("GradeCell", (), {"max_score": 2.0, "grades": []})()


def test_gradebook_comment_renders_as_text(monkeypatch):
    books = []
    monkeypatch.setattr(gradebook, "Gradebook", lambda url: books.append(FakeGradebook(url)) or books[-1])
    item = {"item": "f_test", "score": 0.0, "max_score": 2.0, "status": "error", "reason": HOSTILE_REASON, "counted": True}
    gradebook.write_scores("sqlite://", SPEC, "mallory", [item])
    comment = books[0].comment.auto_comment
    assert len(comment) < 2 * records.MAX_REASON_CHARS
    # nbgrader's feedback template renders comments with markdown2html
    shown = markdown2html(comment)
    assert "<script" not in shown and "<a " not in shown and "&lt;script&gt;" in shown


def test_duplicated_grade_ids_are_tampering():
    released = notebook.graded_cells(nb(cell("f_code", "raise NotImplementedError()", solution=True),
                                        cell("f_test", "assert f()", grade=True)))
    two_tests = notebook.graded_cells(nb(cell("f_code", "f = 1", solution=True), cell("f_test", "assert f()", grade=True),
                                         cell("f_test", "assert f()", grade=True)))
    assert "duplicated grade_id" in notebook.test_cell_problem("f_test", two_tests, released)
    two_solutions = notebook.graded_cells(nb(cell("f_code", "f = 1", solution=True), cell("f_code", "f = 2", solution=True),
                                             cell("f_test", "assert f()", grade=True)))
    assert notebook.test_cell_problem("f_test", two_solutions, released) is None
    assert "'f_code'" in notebook.test_cell_problem("f_test", two_solutions, released, ("f_code",))
    assert "duplicated grade_id" in notebook.solution_problem(("f_code",), two_solutions, released)
    markdown_twin = notebook.graded_cells(nb(cell("f_code", "f = 1", solution=True),
                                             cell("f_code", "text", solution=True, cell_type="markdown")))
    assert "f_code" in markdown_twin.duplicates


def test_hostile_cell_metadata_is_ignored_not_fatal():
    cells = notebook.graded_cells(nb(
        {"cell_type": "code", "metadata": [1], "source": ""},
        {"cell_type": "code", "metadata": {"nbgrader": "x"}, "source": ""},
        7,
        cell("f_code", [1, "x"], solution=True),
    ))
    assert cells.solutions == {"f_code": "1x"}


def test_hidden_test_markers_in_a_student_cell_are_left_alone(tmp_path):
    course = Course(tmp_path / "course")
    write_config(course)
    config = Config()
    exec((course.root / "nbgrader_config.py").read_text(), {"get_config": lambda: config})
    (clear,) = [p for p in config.GenerateFeedback.preprocessors if issubclass(p, ClearHiddenTests)]
    student = "### BEGIN HIDDEN TESTS\ndef f():\n    return 1"
    test = "assert f() == 1\n### BEGIN HIDDEN TESTS\nassert f() != 2\n### END HIDDEN TESTS"
    book = new_notebook(cells=[new_code_cell(student), new_code_cell(test)])
    book.cells[0].metadata["nbgrader"] = {"grade_id": "f_code", "solution": True, "grade": False}
    book.cells[1].metadata["nbgrader"] = {"grade_id": "f_test", "solution": False, "grade": True}
    book, _ = clear(config=config).preprocess(book, {})
    assert book.cells[0].source == student
    assert book.cells[1].source == "assert f() == 1"


@pytest.mark.parametrize("kind, profile, left_out", [
    ("speed", {"name": "cpu"}, True),
    ("speed", {"name": "h100", "gpu": True}, False),
    ("speed", {"name": "cpu", "speed_on_cpu": True}, False),
    ("correctness", {"name": "cpu"}, False),
])
def test_speed_points_need_a_gpu_whatever_the_notebook(kind, profile, left_out):
    item = Item("x", 1.0, (), make_inputs=lambda seed, params: {}, kind=kind)
    assert notebook.needs_gpu(item, profile) is left_out


def test_a_relative_course_folder_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    course = cli._course(cli.parser().parse_args(["--course", "rel", "build"]))
    assert course.root == (tmp_path / "rel").resolve()
    write_config(course)
    assert f"c.CourseDirectory.root = {str(course.root)!r}" in (course.root / "nbgrader_config.py").read_text()


def test_an_invalid_notebook_leaves_speed_points_out_on_the_cpu(tmp_path):
    make = lambda seed, params: {}  # noqa: E731
    lab = LabSpec("01_gemm", [Item("f_test", 2.0, ("f_code",), make),
                              Item("f_speed", 1.0, ("f_code",), make, kind="speed", kernels=("f_kernel",))])
    path = tmp_path / "nb.ipynb"
    path.write_text("{")
    results = grade_submission(lab, path, release=path, profile={"name": "cpu"}, seed=0, student_package=tmp_path)
    rows = [{"student": "s", "lab": lab.name, **r.as_dict()} for r in results]
    assert [(r["status"], r["counted"]) for r in rows] == [("invalid_notebook", True), ("needs_gpu", False)]
    assert pipeline.totals(rows)[("s", lab.name)] == {"score": 0.0, "max": 2.0, "left_out": 1.0}


def test_a_flood_kept_by_nbgrader_is_cut_before_feedback(tmp_path):
    nb = new_notebook(cells=[new_code_cell("print('x' * 10**6)")])
    nb.cells[0].outputs = [{"output_type": "stream", "name": "stdout", "text": "x" * 10**6},
                           {"output_type": "error", "ename": "E", "evalue": "v", "traceback": ["y" * 10**6]}]
    path = tmp_path / "executed.ipynb"
    path.write_text(json.dumps(nb))
    assert notebook.cap_outputs(path)
    cell = json.loads(path.read_text())["cells"][0]
    assert len(cell["outputs"][0]["text"]) < notebook.MAX_OUTPUT_CHARS + 100
    assert len(cell["outputs"][1]["traceback"][0]) < notebook.MAX_OUTPUT_CHARS + 100
    assert not notebook.cap_outputs(path)  # nothing left to cut


class FeedbackCourse(Course):
    """A course whose nbgrader writes a page per student it is asked for, and fails for ``broken``."""

    def __init__(self, root, broken=()):
        super().__init__(root)
        self.broken, self.calls = set(broken), []

    def nbgrader(self, *args, timeout=1800):
        self.calls.append(args)
        lab = args[1]
        if "--student" in args:
            asked = [args[args.index("--student") + 1]]
        else:
            excluded = next(a.split("=", 1)[1] for a in args if a.startswith("--CourseDirectory.student_id_exclude="))
            asked = [p.name for p in (self.root / "autograded").iterdir() if p.name not in excluded.split(",")]
        for student in asked:
            if student not in self.broken:
                self.feedback_dir(student, lab).mkdir(parents=True, exist_ok=True)
                (self.feedback_dir(student, lab) / f"{lab}.html").write_text("page")
        failed = bool(self.broken & set(asked))
        return subprocess.CompletedProcess(args, int(failed), "", "conversion failed" if failed else "")


def _autograded(course, *students):
    for student in students:
        course.autograded(student, LAB).parent.mkdir(parents=True)


def test_feedback_is_one_nbgrader_run_for_the_students_asked_and_leaves_the_others_out(tmp_path):
    course = FeedbackCourse(tmp_path / "course")
    _autograded(course, "ann", "ben", "cat")
    assert pipeline._generate_feedback(course, LAB, ["ann", "ben"]) == []
    assert len(course.calls) == 1 and "--student" not in course.calls[0]
    assert not course.feedback_dir("cat", LAB).exists()


def test_feedback_that_fails_in_one_run_is_made_again_per_student_and_names_the_student(tmp_path):
    course = FeedbackCourse(tmp_path / "course", broken=["ben"])
    _autograded(course, "ann", "ben", "cat")
    failures = pipeline._generate_feedback(course, LAB, ["ann", "ben", "cat"])
    assert len(failures) == 1 and failures[0].startswith("ben: nbgrader generate_feedback failed: conversion failed")
    assert [c[-1] for c in course.calls[1:]] == ["--force"] * 3 and [c[3] for c in course.calls[1:]] == ["ann", "ben", "cat"]


def test_feedback_for_a_name_nbgrader_would_read_as_a_pattern_runs_per_student(tmp_path):
    course = FeedbackCourse(tmp_path / "course")
    _autograded(course, "ann", "b*", "cat")
    assert pipeline._generate_feedback(course, LAB, ["ann", "cat"]) == []
    assert course.calls == [("generate_feedback", LAB, "--student", s, "--force") for s in ("ann", "cat")]
    assert not course.feedback_dir("b*", LAB).exists()
