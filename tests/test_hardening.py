"""Hostile submissions against the parts of the autograder that read, record and report them."""

from autograder import cli
from autograder.course import write_config


def test_a_relative_course_folder_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    course = cli._course(cli.parser().parse_args(["--course", "rel", "build"]))
    assert course.root == (tmp_path / "rel").resolve()
    write_config(course)
    assert f"c.CourseDirectory.root = {str(course.root)!r}" in (course.root / "nbgrader_config.py").read_text()
