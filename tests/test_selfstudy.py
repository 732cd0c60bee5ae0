"""Student mode and self-grading: the working folder, the student kernel, check and progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from autograder import course as course_module
from autograder import hints, selfcheck, selfstudy, tables
from autograder.course import ROOT, Course, build, lab_sources, stray_lab_files
from autograder.engine.items import all_labs
from autograder.strip import strip_package


def _release_course(root: Path) -> Course:
    """A course with a small release notebook for every lab, made without nbgrader (cheap)."""
    course = Course(root)
    for lab in lab_sources():
        nb = new_notebook(cells=[new_markdown_cell(f"# {lab}"), new_code_cell("x = 1")])
        nb.nbformat_minor = 4
        for cell in nb.cells:
            cell.pop("id", None)
        course.release(lab).parent.mkdir(parents=True)
        nbformat.write(nb, course.release(lab))
    return course


def test_working_copies_are_made_once_and_open_unchanged(tmp_path):
    from jupytext import TextFileContentsManager

    course, work = _release_course(tmp_path / "course"), tmp_path / "work"
    made = selfstudy.make_working_copies(course, work)
    assert sorted(p.name for p in made) == sorted(f"{lab}.ipynb" for lab in lab_sources())
    first = made[0]
    nb = nbformat.read(first, as_version=4)
    assert nb.metadata.kernelspec.name == selfstudy.KERNEL_NAME
    # What JupyterLab does on open and save (through jupytext's contents manager, as installed)
    # must leave the file as it is: a lab opens unmodified.
    manager = TextFileContentsManager(root_dir=str(work))
    before = first.read_bytes()
    manager.save(manager.get(first.name), first.name)
    assert first.read_bytes() == before
    # The learner's work is never overwritten, even when the release changes.
    first.write_text(before.decode().replace("x = 1", "x = 42"))
    assert selfstudy.make_working_copies(course, work) == []
    assert "x = 42" in first.read_text()


def test_stale_release_is_found(tmp_path):
    course = _release_course(tmp_path / "course")
    lab = next(iter(lab_sources()))
    assert selfstudy.stale_labs(course) == []
    old = time.time() - 10 * 365 * 86400
    os.utime(course.release(lab), (old, old))
    assert selfstudy.stale_labs(course) == [lab]
    course.release(lab).unlink()
    assert selfstudy.stale_labs(course, [lab]) == [lab]


@pytest.fixture(scope="module")
def student_kernel(tmp_path_factory):
    """The student kernel spec over a student copy of the package (stripped here, no nbgrader)."""
    root = tmp_path_factory.mktemp("student")
    course = Course(root / "course")
    strip_package(ROOT / "fastdl_lab", course.student_package / "fastdl_lab")
    data = root / "jupyter-data"
    selfstudy.install_kernel(course, data)
    return course, data


def test_student_kernel_imports_the_student_package_only(student_kernel, tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    course, data = student_kernel
    manager = KernelManager(kernel_name=selfstudy.KERNEL_NAME,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(data / "kernels")]))
    # JupyterLab starts a notebook's kernel in the notebook's folder: the working folder.
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    code = ("import importlib.util, json, fastdl_lab\n"
            "from fastdl_lab.measure import matmul_flops_ref\n"
            "try:\n    matmul_flops_ref(2, 3, 4); ref = 'answered'\n"
            "except NotImplementedError:\n    ref = 'stub'\n"
            "print(json.dumps({'file': fastdl_lab.__file__, 'ref': ref,\n"
            "                  'grader': importlib.util.find_spec('autograder') is not None}))")
    out = []
    try:
        client.wait_for_ready(timeout=60)
        client.execute_interactive(code, timeout=60, output_hook=lambda msg: out.append(msg))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = "".join(m["content"].get("text", "") for m in out if m["msg_type"] == "stream")
    errors = [m["content"] for m in out if m["msg_type"] == "error"]
    assert not errors, errors
    seen = json.loads(text.strip().splitlines()[-1])
    assert Path(seen["file"]).resolve().is_relative_to(course.student_package.resolve())
    assert seen["ref"] == "stub", "the reference solution is reachable from the student kernel"
    assert seen["grader"] is False, "the grader (hidden checks) is importable from the student kernel"


def test_nbgrader_validate_runs_in_the_student_kernel(student_kernel, tmp_path):
    course, data = student_kernel
    nb = new_notebook(cells=[
        new_code_cell("import fastdl_lab\nanswer = 2 * 21", metadata={"nbgrader": {
            "grade_id": "a_code", "solution": True, "grade": False, "locked": False, "schema_version": 3}}),
        new_code_cell("assert answer == 42\nassert 'student_package' in fastdl_lab.__file__", metadata={"nbgrader": {
            "grade_id": "a_test", "solution": False, "grade": True, "locked": True, "points": 1,
            "schema_version": 3}}),
    ])
    nb.metadata["kernelspec"] = {"name": selfstudy.KERNEL_NAME, "display_name": "x", "language": "python"}
    path = tmp_path / "lab.ipynb"
    nbformat.write(nb, path)
    env = {**course_module.tool_env(), "JUPYTER_DATA_DIR": str(data), "JUPYTER_PATH": str(data)}
    done = subprocess.run([sys.executable, "-m", "nbgrader", "validate", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "Success! Your notebook passes all the tests." in done.stdout, done.stdout + done.stderr


def test_tool_env_puts_this_interpreters_bin_first():
    env = course_module.tool_env({"PATH": "/usr/bin:/bin"})
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin", "/bin"]


def test_a_failed_build_leaves_nothing_half_made(tmp_path, monkeypatch):
    def failing(self, *args, **kwargs):
        # What nbgrader does without alembic: the gradebook file exists, the command fails.
        Path(self.sqlite_file()).write_bytes(b"half")
        return subprocess.CompletedProcess(args, 1, "", "FileNotFoundError: 'alembic'")

    monkeypatch.setattr(Course, "nbgrader", failing)
    fresh = Course(tmp_path / "fresh")
    with pytest.raises(RuntimeError, match="alembic"):
        build(fresh, ["00_measure"])
    assert not fresh.root.exists()
    # An existing course keeps what it had and loses only what the failed build made.
    kept = Course(tmp_path / "kept")
    (kept.root / "records").mkdir(parents=True)
    with pytest.raises(RuntimeError):
        build(kept, ["00_measure"])
    assert sorted(p.name for p in kept.root.iterdir()) == ["records"]


def test_only_registered_labs_are_labs(tmp_path, monkeypatch):
    (tmp_path / "labs").mkdir()
    for lab in all_labs():
        (tmp_path / "labs" / f"{lab}.py").write_text("")
    stray = tmp_path / "labs" / "01_gemm copy.py"
    stray.write_text("")
    (tmp_path / "labs" / "01_gemm_old.py").write_text("")
    monkeypatch.setattr(course_module, "ROOT", tmp_path)
    assert set(lab_sources()) == set(all_labs())
    assert [p.name for p in stray_lab_files()] == ["01_gemm copy.py", "01_gemm_old.py"]
    with pytest.raises(ValueError, match="unknown lab.*01_gemm copy"):
        build(Course(tmp_path / "course"), ["01_gemm copy"])
    (tmp_path / "labs" / "00_measure.py").unlink()
    with pytest.raises(FileNotFoundError, match="labs/00_measure.py"):
        lab_sources()


def test_progress_keeps_the_best_speedup_per_profile_and_shows_gpu_items():
    def record(profile, status, speedup=None):
        details = {"speedup": speedup} if speedup else {}
        return {"profile": profile, "items": [
            {"item": "fwd", "score": 3.0 if status == "passed" else 0.0, "max_score": 3.0, "status": status,
             "reason": "", "counted": True, "details": {}},
            {"item": "speed", "score": 2.0, "max_score": 2.0, "status": "passed", "reason": "", "counted": True,
             "details": details},
            {"item": "gpu_only", "score": 0.0, "max_score": 2.0, "status": "needs_gpu", "reason": "", "counted": False,
             "details": {}}]}

    items = selfcheck.item_progress([record("h100", "passed", 1.7), record("h100", "failed", 1.2),
                                     record("a100", "failed", 3.0)], "h100")
    assert items["speed"]["best_speedup"] == 1.7
    assert items["fwd"]["latest"]["status"] == "failed" and items["fwd"]["ever_passed"]
    view = tables.progress_view({"02_fusion": items, "03_layernorm": None}, "h100")
    assert "best speed-up 1.70x" in view and "needs a GPU" in view and "failed (passed before)" in view
    assert "03_layernorm" in view and f"not checked yet: {hints.check('03')}" in view
    assert all(len(line) <= tables.WIDTH for line in view.splitlines())


def test_progress_says_which_items_were_last_checked_without_the_sandbox():
    from autograder.engine.grade import UNISOLATED

    def record(reason):
        return {"profile": "cpu", "items": [{"item": "fwd", "score": 3.0, "max_score": 3.0, "status": "passed",
                                             "reason": reason, "counted": True, "details": {}}]}

    unsafe_last = selfcheck.item_progress([record("correct"), record(UNISOLATED + "correct")], "cpu")
    safe_last = selfcheck.item_progress([record(UNISOLATED + "correct"), record("correct")], "cpu")
    assert "passed, UNSAFE check" in tables.progress_view({"03_layernorm": unsafe_last}, "cpu")
    assert "UNSAFE" not in tables.progress_view({"03_layernorm": safe_last}, "cpu")


REAL_CHECK_FIXTURE = ROOT / "tests" / "adversarial" / "00_measure-forges-self-progress.py"


@pytest.mark.slow
def test_check_grades_the_working_copy_and_writes_nothing_of_the_course(tmp_path, cpu, capsys, monkeypatch):
    """The one real self-check: lab 00, the timing cell honest, the roofline cell hostile (it tries
    to forge the progress file and the instructor's gradebook and records)."""
    from autograder import cli
    from autograder.submissions import variant

    course, work = Course(tmp_path / "course"), tmp_path / "work"
    build(course, ["00_measure"])
    submitted = variant(course, "00_measure", "someone", REAL_CHECK_FIXTURE)
    work.mkdir()
    (work / "00_measure.ipynb").write_bytes(submitted.read_bytes())
    (course.records / "00_measure").mkdir(parents=True)
    (course.records / "00_measure" / "fastdl-adversarial-canary.json").write_text("{}")
    before = {p: p.read_bytes() for p in course.root.rglob("*") if p.is_file()}
    monkeypatch.setenv(selfstudy.WORK_VAR, str(work))
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the CLI puts its bin first
    started = time.monotonic()
    assert cli.main(["--course", str(course.root), "check", "00", "--profile", "cpu"]) == 0
    took = time.monotonic() - started
    out = capsys.readouterr().out
    after = {p: p.read_bytes() for p in course.root.rglob("*") if p.is_file()}
    assert after == before, "a self-check changed the course folder"
    verdicts = {i["item"]: i for i in selfcheck.history("00_measure", work)[-1]["items"]}
    assert len(selfcheck.history("00_measure", work)) == 1
    assert verdicts["timing"]["status"] == "passed"
    assert verdicts["roofline"]["status"] == "error" and verdicts["roofline"]["score"] == 0
    assert "hint: your code raised an error" in out and "total 3/7" in out
    assert all(len(line) <= tables.WIDTH for line in out.splitlines() if str(tmp_path) not in line), out
    assert cli.main(["progress", "--profile", "cpu"]) == 0
    assert "00_measure           1/2 items pass" in capsys.readouterr().out
    print(f"self-check of lab 00 took {took:.1f} s")
    print(out)


def test_make_lab_starts_jupyterlab_through_the_one_definition(tmp_path):
    """`make lab` runs `python -m autograder lab`, which the browser test starts too; the command
    reads only the self-study settings, lets the kernel choose its plot backend, and passes
    JupyterLab's own options on."""
    from make_recipes import dry_run, grader_call

    from autograder import cli

    done = dry_run("lab", "LAB_ARGS=--no-browser --port 8890")
    assert done.returncode == 0, done.stderr
    _, words = grader_call(done.stdout)
    assert words[0] == "lab" and words[1:] == ["--no-browser", "--port", "8890"]
    parser = cli.parser()
    args, extra = parser.parse_known_args(words)
    assert args.func is cli.cmd_lab and extra == ["--no-browser", "--port", "8890"]

    argv, env = selfstudy.lab_command(tmp_path, "--no-browser", env={"MPLBACKEND": "Agg", "HOME": "/h"})
    assert argv[:4] == [sys.executable, "-m", "jupyter", "lab"] and argv[-1] == "--no-browser"
    assert f"--ServerApp.root_dir={tmp_path}" in argv
    assert env == {"HOME": "/h", "JUPYTER_CONFIG_PATH": str(selfstudy.SETTINGS)}


def test_other_commands_still_refuse_unknown_arguments(capsys):
    from autograder import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["progress", "--no-browser"])
    assert stopped.value.code == 2 and "unrecognized arguments: --no-browser" in capsys.readouterr().err
