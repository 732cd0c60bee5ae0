"""The commands the grader prints for someone to run next run as printed: each is a target of the
Makefile (read with ``make -n``: the target exists and calls the grader as intended) or this
interpreter's grader by its path (read with the CLI's own parser)."""

from __future__ import annotations

import os
import shlex
import sys

import pytest
from make_recipes import ROOT, dry_run, grader_call

from autograder import cli, hints, selfcheck, selfstudy, tables
from autograder.engine.bwrap import IsolationUnavailable
from autograder.engine.grade import UNISOLATED
from autograder.engine.items import load_lab


def _runs(command: str, cwd) -> object:
    """The grader's parsed arguments that ``command``, typed in ``cwd``, ends in; fails where it
    would not run as printed."""
    argv = shlex.split(command)
    environment = {}
    while "=" in argv[0] and not argv[0].startswith((os.sep, os.curdir)):
        name, value = argv.pop(0).split("=", 1)
        environment[name] = value
    if argv[0] == "make":
        done = dry_run(*argv[1:], cwd=cwd)
        assert done.returncode == 0, f"{command!r} in {cwd}: {done.stderr}"
        interpreter, args = grader_call(done.stdout)
        # The recipe runs in the repository (make -C, or typed there).
        assert os.path.abspath(ROOT / interpreter) == os.path.abspath(ROOT / ".venv" / "bin" / "python")
    else:
        assert argv[1:3] == ["-m", "autograder"], command
        interpreter, args = argv[0], argv[3:]
        assert os.path.abspath(os.path.join(cwd, interpreter)) == os.path.abspath(sys.executable), command
    parsed = cli.parser().parse_args(args)
    parsed.environment = environment
    return parsed


def _record(reason_prefix: str = "") -> dict:
    return {"lab": "01_gemm", "student": "self", "profile": "cpu", "notebook": "/home/me/work/01_gemm.ipynb",
            "failures": [], "items": [
                {"item": "row_sum", "score": 3.0, "max_score": 3.0, "status": "passed",
                 "reason": reason_prefix + "correct", "counted": True},
                {"item": "matmul_fp32", "score": 0.0, "max_score": 4.0, "status": "failed",
                 "reason": reason_prefix + "wrong on 3 of 24 hidden inputs; worst element at (17, 5) " * 4,
                 "counted": True},
                {"item": "matmul_speed", "score": 0.0, "max_score": 2.0, "status": "needs_gpu",
                 "reason": reason_prefix + "needs a GPU", "counted": False}]}


def _no_sandbox(*args, **kwargs):
    """A machine where bubblewrap is missing, as ``bwrap.check`` reports it."""
    raise IsolationUnavailable("bubblewrap (bwrap) is not installed")


@pytest.fixture(params=["repository", "elsewhere"])
def typed_in(request, tmp_path, monkeypatch):
    """Where the learner types the printed command: the repository, or any other folder."""
    where = ROOT if request.param == "repository" else tmp_path
    monkeypatch.chdir(where)
    monkeypatch.delenv(selfstudy.WORK_VAR, raising=False)
    return where


def test_a_lab_not_checked_yet_names_a_command_that_checks_it(typed_in):
    view = tables.progress_view({"03_layernorm": None}, "cpu")
    command = view.split("not checked yet: ", 1)[1].splitlines()[0]
    assert command.startswith("make ")
    args = _runs(command, typed_in)
    assert args.command == "check" and load_lab(args.lab).name == "03_layernorm" and not args.unsafe_no_isolation


def test_a_self_check_names_the_command_that_shows_progress(typed_in):
    text = cli.check_text({**_record(), "notebook": str(typed_in / "01_gemm.ipynb")}, "01_gemm", "cpu")
    command = text.split("all labs: ", 1)[1].splitlines()[0]
    assert _runs(command, typed_in).command == "progress"


def test_a_check_without_a_working_copy_names_the_command_that_makes_one(typed_in, capsys, monkeypatch):
    if (ROOT / "work" / "07_distributed.ipynb").exists():
        pytest.skip("this checkout has a working copy of lab 07: the check would grade it")
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the CLI puts its bin first
    assert cli.main(["check", "07"]) == 2
    err = capsys.readouterr().err
    assert "no notebook at" in err
    command = err.split("`")[1]
    # `make lab` runs `autograder lab`, which makes the working copies before it opens JupyterLab.
    assert _runs(command, typed_in).command == ("lab" if command.startswith("make") else "workspace")


def test_with_a_working_folder_of_their_own_the_hints_call_this_interpreter(tmp_path, monkeypatch):
    """``make`` would check ``work/`` instead: the hint keeps to the folder the learner chose."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(selfstudy.WORK_VAR, str(tmp_path / "mine"))
    mine = {selfstudy.WORK_VAR: str(tmp_path / "mine")}
    args = _runs(hints.check("05"), ROOT)
    assert (args.command, args.lab, args.environment) == ("check", "05", mine)
    assert (_runs(hints.progress(), ROOT).command, _runs(hints.progress(), ROOT).environment) == ("progress", mine)
    assert _runs(hints.workspace(), ROOT).environment == mine


@pytest.mark.parametrize("argv, make_form", [(["check", "01"], True), (["check", "gemm", "--profile", "cpu"], False)])
def test_a_check_that_cannot_be_isolated_names_the_unsafe_command(argv, make_form, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv(selfstudy.WORK_VAR, raising=False)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the CLI puts its bin first
    monkeypatch.setattr(selfcheck, "check", _no_sandbox)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--unsafe-no-isolation to grade anyway" not in err
    command = err.strip().splitlines()[-1].strip()
    assert command.startswith("make grade LAB=01 UNSAFE=1" if make_form else hints.python()), command
    args = _runs(command, ROOT)
    assert args.command == "check" and load_lab(args.lab).name == "01_gemm" and args.unsafe_no_isolation
    assert args.profile == (None if make_form else "cpu")


def test_an_instructors_command_that_cannot_be_isolated_is_named_whole(tmp_path, capsys, monkeypatch):
    from autograder import batch

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", os.environ["PATH"])
    monkeypatch.setattr(batch.bwrap, "check", _no_sandbox)
    course = str(tmp_path / "course")
    assert cli.main(["--course", course, "autograde", "01_gemm", "--student", "alice", "--engine-only"]) == 2
    command = capsys.readouterr().err.strip().splitlines()[-1].strip()
    args = _runs(command, ROOT)
    assert (args.course, args.command, args.lab, args.student, args.engine_only, args.unsafe_no_isolation) == \
        (course, "autograde", "01_gemm", ["alice"], True, True)


def test_the_unsafe_command_does_not_print_a_gradebook_password_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", os.environ["PATH"])
    monkeypatch.setattr(selfcheck, "check", _no_sandbox)
    url = "postgresql://grader:s3cret@db.invalid/course"
    assert cli.main(["--db-url", url, "check", "01"]) == 2
    command = capsys.readouterr().err.strip().splitlines()[-1].strip()
    assert "s3cret" not in command
    args = _runs(command, ROOT)
    assert args.db_url == "postgresql://grader:***@db.invalid/course" and args.unsafe_no_isolation


def test_an_unisolated_self_check_says_unsafe_on_every_line():
    text = cli.check_text(_record(UNISOLATED), "01_gemm", "cpu", isolated=False)
    lines = text.splitlines()
    assert all(line.startswith("UNSAFE") for line in lines), text
    assert all(len(line) <= tables.WIDTH for line in lines), text
    assert "WITHOUT the sandbox" in lines[0] and "your own notebook" in lines[1]
    # Said once per line, not again by each reason.
    assert UNISOLATED.strip() not in text and "wrong on 3 of 24" in text
    assert "UNSAFE" not in cli.check_text(_record(), "01_gemm", "cpu")


def test_the_regrade_command_reaches_the_same_course(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = cli.parser().parse_args(["--course", str(tmp_path / "c"), "autograde", "01_gemm"])
    cli._print_seed(f"{cli._course_option(args)}autograde 01_gemm", 42, {"name": "cpu"})
    again = _runs(capsys.readouterr().out.strip().splitlines()[-1].strip(), ROOT)
    assert (again.course, again.lab, again.seed, again.profile) == (str(tmp_path / "c"), "01_gemm", 42, "cpu")


def test_usage_and_the_driver_hint_name_this_interpreter(monkeypatch):
    from autograder import gradebook

    monkeypatch.chdir(ROOT)
    usage = cli.parser().format_usage().removeprefix("usage: ")
    assert _runs(usage[:usage.index(" [")] + " progress", ROOT).command == "progress"

    def no_driver(*args, **kwargs):
        raise ImportError("No module named 'psycopg2'", name="psycopg2")

    monkeypatch.setattr(gradebook.sa, "create_engine", no_driver)
    with pytest.raises(gradebook.GradebookUnavailable) as missing:
        gradebook.check("postgresql://grader@db.invalid/course")
    command = str(missing.value).split("(", 1)[1].split(")", 1)[0]
    argv = shlex.split(command)
    assert os.path.abspath(argv[0]) == os.path.abspath(sys.executable)
    assert argv[1:] == ["-m", "pip", "install", "psycopg2-binary"]
