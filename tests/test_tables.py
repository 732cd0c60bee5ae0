"""Readable output: tables within 100 columns, rounded scores, the seed's regrade command, report paths."""

from __future__ import annotations

import csv
import os
import shlex
import sys

from autograder import cli, pipeline, records, tables
from autograder.course import Course

LONG_REASON = "wrong on 3 of 24 hidden inputs; worst element at (17, 5): got 1.25, expected 1.5 " * 6


def _rows():
    return [
        {"student": "a-student-with-a-very-long-folder-name", "lab": "04_mixed_precision", "item": "fused_adamw_launches",
         "score": 2 * 4 / 3, "max_score": 4.0, "status": "partial", "reason": LONG_REASON},
        {"student": "bob", "lab": "02_fusion", "item": "softmax_speed", "score": 0.0, "max_score": 2.0,
         "status": "needs_gpu", "reason": "needs a GPU: speed is graded only on GPU profiles; left out of the total"},
    ]


def test_grade_table_fits_100_columns_with_rounded_scores():
    table = tables.grade_table(_rows())
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "2.67/4" in table and "2.6666" not in table
    assert "(all of it in the CSV)" in table
    assert "(2 points need a GPU: left out)" in table


def test_cli_table_keeps_hostile_names_on_their_lines():
    row = {"student": "eve\x1b[1A\nfake", "lab": "01_gemm", "item": "f_test", "score": 2.0, "max_score": 2.0,
           "status": "passed", "reason": "ok\rfake 9/9"}
    table = tables.grade_table([row])
    assert "\x1b" not in table and "\r" not in table
    # header, rule, the row, its reason, a blank line, the total
    assert len(table.splitlines()) == 6


def test_csv_keeps_full_precision(tmp_path):
    course = Course(tmp_path / "course")
    item = {"item": "fused_adamw_launches", "score": 2 * 4 / 3, "max_score": 4.0, "status": "partial",
            "reason": LONG_REASON, "counted": True}
    records.write(course.records, "04_mixed_precision", "s", profile="cpu", seed=1, items=[item], nbgrader={})
    csv_path, _ = pipeline.write_report(course, tmp_path / "r.csv")
    row = next(csv.DictReader(csv_path.open()))
    assert float(row["score"]) == 2 * 4 / 3


def test_report_paths_default_beside_the_course(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the CLI puts its bin first
    course = tmp_path / "build" / "course"
    assert cli.main(["--course", str(course), "report", "--csv"]) == 0
    assert (tmp_path / "build" / "report.csv").is_file() and (tmp_path / "build" / "report.records.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]
    assert cli.report_paths(Course(tmp_path / "x" / "course"))["csv"] == tmp_path / "x" / "report.csv"


def test_the_printed_regrade_command_parses_with_the_seed(capsys):
    cli._print_seed("autograde 01_gemm", 123456789, {"name": "cpu"})
    command = capsys.readouterr().out.strip().splitlines()[-1]
    argv = shlex.split(command)
    # This interpreter by its path: a bare `python` is not the venv's where the venv is not activated.
    assert os.path.abspath(argv[0]) == os.path.abspath(sys.executable) and argv[1:3] == ["-m", "autograder"]
    args = cli.parser().parse_args(argv[3:])
    assert (args.command, args.lab, args.seed, args.profile) == ("autograde", "01_gemm", 123456789, "cpu")
