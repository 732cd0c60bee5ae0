"""make gpu-class on any host: its verdict on made-up records, its rows, and its dry run on a CPU host."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_class", ROOT / "benchmarks" / "gpu_class.py")
gpu_class = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_class)


def item(name, score, max_score, status, reason="", counted=True, **details):
    return {"item": name, "score": score, "max_score": max_score, "status": status, "reason": reason,
            "counted": counted, "wall_s": 1.5, "details": details}


def record(lab, student, *items):
    return {"lab": lab, "student": student, "items": list(items)}


def targets(lab, student):
    return {"buggy-k-remainder": ["matmul_fp32", "matmul_speed"]}.get(student)


GOOD = [
    record("01_gemm", "reference", item("matmul_fp32", 4, 4, "passed"), item("matmul_speed", 2, 2, "passed", speedup=0.7)),
    record("01_gemm", "untouched", item("matmul_fp32", 0, 4, "unanswered"), item("matmul_speed", 0, 2, "unanswered")),
    record("01_gemm", "buggy-k-remainder", item("matmul_fp32", 0, 4, "failed"), item("matmul_speed", 0, 2, "failed")),
    # Lab 08's GPU items on a host without RAPIDS say so, and are left out of the verdict.
    record("08_rapids", "reference", item("etl_gpu_speed", 0, 2, "not_graded", "not graded, a fault of the grading "
                                          "machine: MachineLacks: needs RAPIDS on this GPU host: cudf missing")),
]


def test_a_class_that_scores_as_its_demos_promise_has_no_problem():
    assert gpu_class.class_problems(GOOD, targets) == []


@pytest.mark.parametrize("changed, expected", [
    (record("01_gemm", "reference", item("matmul_speed", 0, 2, "failed", "speedup 0.30x")), "reference is below full"),
    (record("01_gemm", "buggy-k-remainder", item("matmul_fp32", 4, 4, "passed"), item("matmul_speed", 2, 2, "passed")),
     "passes every item its mistake reaches"),
    (record("01_gemm", "buggy-k-remainder", item("grouped_order", 0, 2, "failed")), "cannot reach"),
    (record("01_gemm", "untouched", item("matmul_fp32", 1, 4, "partial")), "untouched release scores"),
    (record("01_gemm", "buggy-k-remainder", item("matmul_fp32", 0, 4, "not_graded", "FileNotFoundError: gcc")),
     "not graded"),
])
def test_each_broken_promise_is_named(changed, expected):
    problems = gpu_class.class_problems([*GOOD, changed], targets)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_mistake_that_reaches_an_item_without_changing_it_is_noted_not_failed():
    # A naive variance runs in the backward's cell and passes its check; it fails the stability item.
    reached = lambda lab, student: ["layernorm_bwd", "layernorm_stability"]  # noqa: E731
    naive = record("03_layernorm", "buggy-naive-variance", item("layernorm_bwd", 3, 3, "passed"),
                   item("layernorm_stability", 0, 2, "failed"))
    assert gpu_class.class_problems([naive], reached) == []
    assert gpu_class.unharmed([naive], reached) == ["03_layernorm buggy-naive-variance layernorm_bwd"]


def test_one_row_per_item_with_the_gpu_and_its_clock(tmp_path):
    gpu = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_clocks_sm": "1980"}
    rows = gpu_class.class_rows(GOOD, gpu=gpu, profile="h100", date="2026-12-01T10:00:00+00:00")
    path = tmp_path / "gpu_class.csv"
    gpu_class.append_rows(rows, path)
    gpu_class.append_rows(rows[:1], path)
    read = list(csv.DictReader(path.open()))
    assert list(read[0]) == gpu_class.COLUMNS
    assert len(read) == 8 and read[1]["speedup"] == "0.7" and read[0]["speedup"] == ""
    assert read[1]["gpu_clocks_sm"] == "1980" and read[1]["profile"] == "h100" and read[1]["seconds"] == "1.5"


def test_the_planned_class_is_the_one_the_demo_writes(course):
    from autograder.engine.items import all_labs
    from autograder.submissions import demo_students

    for lab in all_labs():
        assert gpu_class.planned_students(lab) == demo_students(course, lab)


def test_a_cpu_host_gets_a_dry_run_that_names_every_lab_student_and_item():
    from autograder.engine.items import all_labs
    from fastdl_lab import device

    if device.has_gpu():
        pytest.skip("checks the CPU-host answer")
    table = ROOT / "benchmarks" / "results" / "gpu_class.csv"
    before = table.read_bytes() if table.exists() else None
    done = subprocess.run(["make", "-s", "gpu-class", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "dry run (no GPU on this host): nothing is graded" in done.stdout
    for lab in all_labs().values():
        assert f"{lab.name}: {len(lab.items)} items" in done.stdout
        for student in gpu_class.planned_students(lab.name):
            assert f"  {student}: " in done.stdout
    assert "buggy-k-remainder: loses points on some of matmul_fp32, matmul_fp16, matmul_speed" in done.stdout
    assert (table.read_bytes() if table.exists() else None) == before  # nothing graded, nothing written


_carry_spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "benchmarks" / "gpu_carry.py")
gpu_carry = importlib.util.module_from_spec(_carry_spec)
_carry_spec.loader.exec_module(gpu_carry)


def test_the_carry_holds_what_the_image_lacks_and_nothing_it_has():
    found = {"nbgrader": "0.9.6", "SQLAlchemy": "2.1.9", "torch": "2.13.0", "typing_extensions": "4.15.0",
             "Jinja2": "3.1.6", "fastdl-lab": "0.1.0", "jupyter_core": "5.9.1"}
    assert gpu_carry.to_carry(found) == {"SQLAlchemy": "2.1.9", "jupyter_core": "5.9.1", "nbgrader": "0.9.6"}


def test_the_grading_path_imports_nbgrader_and_the_gradebook_from_this_environment():
    found = {gpu_carry.normalise(name) for name in gpu_carry.imported_distributions(sys.executable)}
    assert {"nbgrader", "sqlalchemy", "alembic", "jupytext", "nbformat", "torch"} <= found
