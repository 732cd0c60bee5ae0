"""A fault of the grading machine is never the student's error (autograder/engine/faults.py).

On a GPU image whose compilers were outside the sandbox, every kernel item of the reference was
graded "your code raised FileNotFoundError: ... '/opt/gcc/bin/gcc'". Such an item is now
``not_graded`` with the machine's reason, and the run says so first.
"""

import subprocess
from pathlib import Path

import pytest

from autograder.engine import faults, grade, toolchain
from autograder.engine.sandbox import ChildResult

ROOT = Path(__file__).resolve().parent.parent


def _bench_gpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the exception is what is tested
        return exc
    raise AssertionError("nothing was raised")


def test_a_compiler_that_cannot_be_run_is_the_machines_fault():
    exc = _raised(lambda: subprocess.run(["/opt/gcc/bin/gcc", "--version"]))
    assert "(/opt/gcc/bin/gcc)" in faults.exception_fault(exc, gpu=True)
    # torch's extension build raises its own error from the compiler's: the cause is followed.
    def build():
        try:
            subprocess.run(["g++", "-v"], env={"PATH": "/nonexistent"})
        except FileNotFoundError as missing:
            raise RuntimeError("Error building extension 'lltm'") from missing
    assert "(g++)" in faults.exception_fault(_raised(build), gpu=False)
    assert faults.exception_fault(FileNotFoundError("no nvcc on PATH, under $CUDA_HOME"), gpu=False)


@pytest.mark.parametrize("cc", [None, "/opt/gcc/bin/gcc"], ids=["no compiler at all", "a compiler not there"])
def test_tritons_own_launcher_build_failing_is_the_machines_fault(tmp_path, monkeypatch, cc):
    """Triton's real build function (what the first launch on a GPU calls), on a machine without
    the compiler it is pointed at."""
    from triton.runtime import build

    monkeypatch.setenv("PATH", str(tmp_path))
    if cc:
        monkeypatch.setenv("CC", cc)
    else:
        monkeypatch.delenv("CC", raising=False)
    source = tmp_path / "stub.c"
    source.write_text("int stub(void) { return 0; }\n")
    exc = _raised(lambda: build._build("stub", str(source), str(tmp_path), [], [], [], []))
    assert faults.exception_fault(exc, gpu=True)
    assert faults.exception_fault(exc, gpu=False)  # the build itself, wherever it ran


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    AssertionError("wrong sum"),
    ValueError("shapes do not match"),
    FileNotFoundError(2, "No such file or directory", "data.csv"),
    FileNotFoundError("no such file as input.bin"),
    NameError("name 'tl' is not defined"),
], ids=str)
def test_what_a_submission_does_wrong_stays_its_error(exc):
    assert faults.exception_fault(exc, gpu=True) is None


def test_no_gpu_is_the_machines_fault_only_where_the_child_was_given_one():
    exc = RuntimeError("Found no NVIDIA driver on your system.")
    assert faults.exception_fault(exc, gpu=True)
    # On a CPU profile the grader hides the GPU: code that asks for one made that mistake itself.
    assert faults.exception_fault(exc, gpu=False) is None
    drivers = RuntimeError("0 active drivers ([]). There should only be one.")  # Triton with no GPU
    assert faults.exception_fault(drivers, gpu=True) and faults.exception_fault(drivers, gpu=False) is None
    assert faults.exception_fault(ImportError("libcudart.so.13: cannot open shared object file: No such file"),
                                  gpu=False)


def test_the_child_reports_a_machine_fault_by_its_own_status(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert faults.child_status(_raised(lambda: subprocess.run(["/opt/gcc/bin/g++"]))) == faults.MACHINE
    assert faults.child_status(ValueError("wrong")) == "error"


def test_the_parent_reads_a_fault_from_the_report_or_a_sandbox_that_never_started():
    assert faults.machine_fault((faults.MACHINE, "FileNotFoundError: 'gcc'"), "").endswith("FileNotFoundError: 'gcc'")
    assert faults.machine_fault(("error", "ValueError: wrong"), "") is None
    started = faults.machine_fault(None, "bwrap: Can't mount proc on /newroot/proc: Operation not permitted\n")
    assert "the sandbox could not start: bwrap: Can't mount proc" in started
    assert faults.machine_fault(None, "sandbox setup failed (filesystem): ro-bind /opt/gcc: No such file\n")
    assert faults.machine_fault(None, "Traceback (most recent call last):\nValueError: wrong\n") is None


def test_an_item_whose_child_hit_a_machine_fault_is_not_graded(tmp_path):
    from autograder.engine import channel

    received = channel.Received(errors=[{"status": faults.MACHINE, "error": "FileNotFoundError: [Errno 2] No such "
                                                                             "file or directory: '/opt/gcc/bin/gcc'"}])
    item = grade.Item("row_sum", 2, (), lambda seed, params: {})
    result = grade._failure(item, grade._Run(ChildResult("error", "exited with code 3", 3, 1.0), received))
    assert (result.status, result.score, result.counted) == ("not_graded", 0.0, True)
    assert result.reason.startswith(faults.PREFIX) and "/opt/gcc/bin/gcc" in result.reason
    assert "your code" not in result.reason


@pytest.mark.slow
def test_lab_09s_build_without_its_compiler_in_the_sandbox_is_not_graded(tmp_path, monkeypatch):
    """The reference's C++ item, graded by the engine in the sandbox, on a machine whose C++
    compiler lives under a prefix the sandbox does not show: the H100 image's failure, before the
    toolchain binds. It is the machine's fault, not the reference's."""
    from autograder import profiles
    from autograder.engine import bwrap
    from autograder.engine.items import load_lab
    from autograder.strip import strip_package

    bwrap.check()
    gxx = tmp_path / "opt" / "gcc" / "bin" / "g++"
    gxx.parent.mkdir(parents=True)
    gxx.write_text(f"#!/bin/sh\nexec {subprocess.check_output(['which', 'g++'], text=True).strip()} \"$@\"\n")
    gxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(gxx))
    monkeypatch.setattr(toolchain, "find", lambda *args, **kwargs: toolchain.Toolchain(None, None, None, (), ()))
    monkeypatch.setattr(grade, "_precompiled_headers", lambda: None)
    student = tmp_path / "student_package"
    strip_package(ROOT / "fastdl_lab", student / "fastdl_lab")
    lab = load_lab("09_custom_ops")
    item = lab.item("cpp_lltm")
    result = grade._grade_item(lab, item, _bench_gpu().reference_cells(ROOT / "labs" / "09_custom_ops.py"), 7,
                               grade.Sandbox(student, profiles.load("cpu")))
    assert result.status == "not_graded", result
    # The build's reason names the compiler without its folders (sources.first_compiler_error).
    assert "No such file or directory: 'g++'" in result.reason and "your code" not in result.reason
