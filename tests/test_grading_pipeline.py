"""The course through the real nbgrader pipeline: build, release, autograde, feedback, report.

One course is built per test session; each test adds its own students. Bad inputs are graded
by the engine directly (fast) and, for the ones that break nbgrader itself, through the pipeline.
The demo students of every lab are graded once per session, as one batch: the `demo` fixture in
conftest.py, which the browser tests read too.
"""

import csv
import json
import os
import re
import time

import nbformat
import pytest
from nbgrader.api import Gradebook

from autograder import pipeline, strip
from autograder.course import lab_sources
from autograder.engine import prefork
from autograder.engine.grade import grade_submission
from autograder.engine.items import all_labs, load_lab
from autograder.engine.sandbox import descendants
from autograder.submissions import FIXTURE_DIR, demo_targets, make_submission, reference_solutions, variant
from conftest import DEMO_SEED

pytestmark = pytest.mark.slow
# The seed the demo fixture (conftest.py) grades with.
SEED = DEMO_SEED


def rows_for(course, student, lab):
    return {r["item"]: r for r in pipeline.report_rows(course) if r["student"] == student and r["lab"] == lab}


def engine(course, cpu, lab, student, only=None, **overrides):
    profile = {**cpu, **overrides}
    return {r.item: r for r in grade_submission(
        load_lab(lab), course.submitted(student, lab), release=course.release(lab), profile=profile,
        seed=SEED, student_package=course.student_package, only=only)}


def test_every_lab_has_a_grading_spec_and_matching_cells(course):
    assert set(lab_sources()) == set(all_labs())
    for lab in all_labs().values():
        nb = nbformat.read(course.source(lab.name), as_version=4)
        ids = {c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata}
        for item in lab.items:
            assert item.name in ids, f"{lab.name}: no test cell for item {item.name}"
            assert set(item.cells) <= ids, f"{lab.name}: solution cells of {item.name} missing"


def test_release_leaks_no_solution_and_no_hidden_test(course):
    for lab in all_labs():
        source = nbformat.read(course.source(lab), as_version=4)
        release_text = course.release(lab).read_text()
        secret_lines, open_lines = set(), set()
        regions = r"### BEGIN SOLUTION\n(.*?)### END SOLUTION|### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS"
        for cell in source.cells:
            for region in re.findall(regions, cell.source, re.S):
                secret_lines |= {ln.strip() for ln in "".join(region).splitlines() if len(ln.strip()) > 12}
            open_lines |= {ln.strip() for ln in re.sub(regions, "", cell.source, flags=re.S).splitlines()}
        # A line the source also shows outside every region (a scaffold's loads, which a solution
        # elsewhere repeats) is handed out on purpose.
        secret_lines -= open_lines
        assert secret_lines, f"{lab}: the source has no solution regions to hide"
        released = nbformat.reads(release_text, as_version=4)
        visible = {ln.strip() for c in released.cells for ln in c.source.splitlines()}
        assert "BEGIN SOLUTION" not in release_text and "HIDDEN TESTS" not in release_text
        assert not secret_lines & visible, f"{lab}: release shows {sorted(secret_lines & visible)[:3]}"
    package_text = "".join(p.read_text() for p in (course.student_package / "fastdl_lab").rglob("*.py"))
    assert strip.BEGIN not in package_text and strip.STUB in package_text
    assert "tl.dot(a, b, acc)" not in package_text  # the reference GEMM's inner loop


def test_reference_scores_full_marks_through_nbgrader(demo):
    for lab in all_labs().values():
        course = demo[lab.name].course
        assert not [f for f in demo[lab.name].summary.failures if f.startswith("reference")]
        rows = rows_for(course, "reference", lab.name)
        for item in lab.items:
            row = rows[item.name]
            if item.is_speed:
                assert row["status"] == "needs_gpu" and row["score"] == 0
            else:
                assert row["status"] == "passed", row
                assert row["score"] == item.points
        counted = sum(it.points for it in lab.items if not it.is_speed)
        with Gradebook(course.db_url) as gb:
            assert gb.find_submission(lab.name, "reference").score == pytest.approx(counted)


def test_reference_notebook_records_are_clean(demo):
    """What nbgrader's run of each reference left in the notebook the student gets back: no
    error, and nothing on stderr but the engine's notes and the profiler's trace markers. A
    sandbox without fonts, host names or a writable /tmp has every notebook print fontconfig's
    and gloo's complaints."""
    from autograder.execute import NOT_RUN

    for lab in all_labs().values():
        course = demo[lab.name].course
        executed = nbformat.read(course.autograded("reference", lab.name), as_version=4)
        for index, cell in enumerate(executed.cells):
            for output in cell.get("outputs", []):
                assert output.output_type != "error", (lab.name, index, output.get("evalue"))
                if output.get("name") == "stderr" and output.text != NOT_RUN:
                    noise = [ln for ln in output.text.splitlines() if ln.strip() and not ln.startswith("USDT:")]
                    assert noise == [], (lab.name, index, noise[:3])


def test_untouched_release_scores_zero_without_crashing(demo):
    for lab in all_labs().values():
        rows = rows_for(demo[lab.name].course, "untouched", lab.name)
        assert all(r["score"] == 0 for r in rows.values())
        assert {r["status"] for r in rows.values()} <= {"unanswered", "needs_gpu"}
        assert not [f for f in demo[lab.name].summary.failures if f.startswith("untouched")]


def test_buggy_demos_lose_points_with_reasons(demo):
    for lab in all_labs().values():
        course = demo[lab.name].course
        buggy = [s for s in course.students(lab.name) if s.startswith("buggy-")]
        assert buggy, f"{lab.name} has no buggy demo submission"
        for student in buggy:
            rows = rows_for(course, student, lab.name)
            targets = demo_targets(lab.name, student)
            assert targets, f"{student} replaces no cell an item executes"
            if student not in demo[lab.name].executed:
                assert set(rows) == set(targets)
            lost = [r for r in rows.values() if r["status"] not in ("passed", "needs_gpu")]
            assert lost, f"{student} lost nothing"
            assert {r["item"] for r in lost} <= set(targets), f"{student} lost points its mistake cannot reach"
            assert all(r["reason"] and r["status"] != "not_graded" for r in lost)


def test_feedback_shows_verdicts_and_no_hidden_tests(demo, monkeypatch):
    lab = load_lab("01_gemm")
    course = demo[lab.name].course
    calls, nbgrader = [], type(course).nbgrader

    def counted(self, *args, **kwargs):
        calls.append(args)
        return nbgrader(self, *args, **kwargs)

    monkeypatch.setattr(type(course), "nbgrader", counted)
    started = time.time()
    assert pipeline.feedback(course, lab, ["reference", "buggy-k-remainder"]) == []
    # One nbgrader run for both, and nobody else's page written by it.
    assert len(calls) == 1 and calls[0][:2] == ("generate_feedback", lab.name)
    others = set(course.students(lab.name)) - {"reference", "buggy-k-remainder"}
    assert others and not [page for student in others for page in course.feedback_dir(student, lab.name).glob("*.html")
                           if page.stat().st_mtime >= started - 1]
    source = nbformat.read(course.source(lab.name), as_version=4)
    hidden = set()
    for cell in source.cells:
        for region in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", cell.source, re.S):
            hidden |= {ln.strip() for ln in region.splitlines() if len(ln.strip()) > 12}
    for student in ("reference", "buggy-k-remainder"):
        html = (course.feedback_dir(student, lab.name) / f"{lab.name}.html").read_text()
        assert "Autograder verdict for &#39;matmul_fp32&#39;" in html or "Autograder verdict for 'matmul_fp32'" in html
        for line in hidden:
            assert line not in html, f"feedback of {student} shows a hidden test line: {line}"
    assert "hidden cases correct" in (course.feedback_dir("buggy-k-remainder", lab.name) / f"{lab.name}.html").read_text()


def test_report_csv_and_records(demo, tmp_path):
    csv_path, record_path = pipeline.write_report(demo["01_gemm"].course, tmp_path / "report.csv")
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == pipeline.REPORT_COLUMNS
    assert {r["student"] for r in rows} >= {"reference", "untouched"}
    records = json.loads(record_path.read_text())
    assert all({"seed", "hardware", "versions", "profile"} <= set(r) for r in records)
    assert records[0]["seed"] == SEED


# A kernel item runs only the cell's @triton.jit functions: code around them (an abort, a flood, a
# patched launcher) never runs, and a cell without the kernel is not_a_kernel. A real kernel that
# writes out of bounds raises in its child (fastdl_lab.bounds), which names the tensor, and loses
# only its items.
@pytest.mark.parametrize("fixture, status", [
    ("01_gemm-abort", "not_a_kernel"),
    ("01_gemm-oob-store", "error"),
    ("01_gemm-flood", "not_a_kernel"),
    ("01_gemm-library", "not_a_kernel"),
])
def test_bad_kernel_loses_only_its_items(course, cpu, fixture, status):
    variant(course, "01_gemm", fixture, FIXTURE_DIR / f"{fixture}.py")
    results = engine(course, cpu, "01_gemm", fixture)
    for item in ("matmul_fp32", "matmul_fp16"):
        assert results[item].status == status and results[item].score == 0, results[item]
        assert results[item].reason
        if "oob" in fixture:  # 2**40 elements past C: no tensor of the launch is named
            assert "OutOfBoundsAccess: out-of-bounds store in kernel 'matmul_kernel'" in results[item].reason
            assert "far outside every tensor of the launch" in results[item].reason
    assert results["grouped_order"].status == "passed"


def test_lab05_optional_dq_left_as_released_costs_only_its_point(course, cpu):
    # The core backward is graded on the reference forward's output: neither the dQ kernel nor
    # the forward kernel is needed for its points.
    cells = {cell: source for cell, source in reference_solutions(course, "05_attention").items()
             if cell not in ("attn_bwd_dq_code", "attn_fwd_code")}
    make_submission(course, "05_attention", "core-only", cells)
    results = engine(course, cpu, "05_attention", "core-only", only={"attention_bwd", "attention_bwd_dq"})
    assert results["attention_bwd"].status == "passed" and results["attention_bwd"].score == 3
    assert results["attention_bwd_dq"].status == "unanswered" and results["attention_bwd_dq"].score == 0


def test_looping_kernel_times_out(course, cpu):
    variant(course, "01_gemm", "loop", FIXTURE_DIR / "01_gemm-loop.py")
    results = engine(course, cpu, "01_gemm", "loop", only={"matmul_fp32", "grouped_order"},
                     limits={**cpu["limits"], "wall_s": 8})
    assert results["matmul_fp32"].status == "timeout"
    assert "wall-time limit" in results["matmul_fp32"].reason
    assert results["grouped_order"].status == "passed"


@pytest.mark.parametrize("fixture, lost, kept, status", [
    ("02_fusion-oob-store", ("softmax_fp32", "softmax_fp16"), ("softmax_bytes", "conv_bn_fold"), "error"),
    ("03_layernorm-loop", ("layernorm_bwd", "layernorm_training"), ("layernorm_fwd_fp32", "layernorm_stability"), "timeout"),
    ("03_layernorm-no-kernel", ("layernorm_bwd", "layernorm_training"), ("layernorm_fwd_fp32", "layernorm_stability"),
     "not_a_kernel"),
])
def test_later_labs_contain_bad_kernels_too(course, cpu, fixture, lost, kept, status):
    lab = fixture.split("-")[0]
    variant(course, lab, fixture, FIXTURE_DIR / f"{fixture}.py")
    results = engine(course, cpu, lab, fixture, only={*lost, *kept}, limits={**cpu["limits"], "wall_s": 12})
    for item in lost:
        assert results[item].status == status and results[item].score == 0, results[item]
        if "oob" in fixture:
            assert "out-of-bounds store in kernel 'softmax_kernel'" in results[item].reason
    for item in kept:
        assert results[item].status == "passed", results[item]


def test_a_cpp_build_error_is_a_verdict_with_the_compilers_first_error(course, cpu):
    variant(course, "09_custom_ops", "does-not-build", FIXTURE_DIR / "09_custom_ops-does-not-build.py")
    lab = load_lab("09_custom_ops")
    results = {r.item: r for r in grade_submission(
        lab, course.submitted("does-not-build", lab.name), release=course.release(lab.name), profile=cpu, seed=SEED,
        student_package=course.student_package, only={"cpp_lltm", "per_channel_int8"})}
    cpp = results["cpp_lltm"]
    assert cpp.status == "error" and cpp.score == 0, cpp
    assert "does not build" in cpp.reason and "error: expected" in cpp.reason, cpp.reason
    # The build's private folder is not in the reason, only the file name the compiler reports.
    assert "/job/" not in cpp.reason and "torch_extensions" not in cpp.reason
    assert results["per_channel_int8"].status == "passed"


def test_lab_07_takes_its_collective_timeout_from_the_profile():
    from autograder.labs.lab07_distributed import RANK_TIMEOUT_S

    ring = load_lab("07_distributed").item("ring_allreduce")
    params = {"worlds": [[2, [1, 5]]]}
    assert ring.make_inputs(0, params)["timeout_s"] == RANK_TIMEOUT_S
    assert ring.make_inputs(0, {**params, "rank_timeout_s": 5})["timeout_s"] == 5.0


@pytest.mark.distributed
def test_a_deadlocked_rank_loses_its_item_and_leaves_nothing(course, cpu):
    variant(course, "07_distributed", "deadlock", FIXTURE_DIR / "07_distributed-deadlock.py")
    lab = load_lab("07_distributed")
    # The deadlock lasts until the collective timeout: a short one, for the ring item only.
    labs = json.loads(json.dumps(cpu["labs"]))
    labs["07_distributed"]["ring_allreduce"]["rank_timeout_s"] = 5
    results = {r.item: r for r in grade_submission(
        lab, course.submitted("deadlock", lab.name), release=course.release(lab.name), profile={**cpu, "labs": labs},
        seed=SEED, student_package=course.student_package, only={"ring_allreduce", "zero1"})}
    ring = results["ring_allreduce"]
    assert ring.status == "error" and ring.score == 0, ring
    assert "rank" in ring.reason
    assert results["zero1"].status == "passed"
    # Nothing of the world survives: no process below this test runs the child entry point, and
    # no sandbox forked by this process's fork servers (a monitor, and all below it) is left.
    leftovers = [pid for server in prefork.server_pids() for pid in descendants(server)[1:]]
    for pid in descendants(os.getpid())[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"autograder.engine.child" in f.read():
                    leftovers.append(pid)
        except OSError:
            pass
    assert leftovers == []


def _edit(course, student, lab, change):
    path = make_submission(course, lab, student, reference_solutions(course, lab))
    nb = json.loads(path.read_text())
    change(nb)
    path.write_text(json.dumps(nb))


def test_deleted_and_edited_test_cells_are_named(course, cpu):
    def delete(nb):
        nb["cells"] = [c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") != "matmul_fp16"]

    def edit(nb):
        for c in nb["cells"]:
            if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "matmul_fp32":
                c["source"] = "pass\n"

    _edit(course, "deleted", "01_gemm", delete)
    _edit(course, "edited", "01_gemm", edit)
    deleted = engine(course, cpu, "01_gemm", "deleted")
    edited = engine(course, cpu, "01_gemm", "edited")
    assert deleted["matmul_fp16"].status == "tampered" and "deleted" in deleted["matmul_fp16"].reason
    assert deleted["matmul_fp32"].status == "passed"
    assert edited["matmul_fp32"].status == "tampered" and "edited" in edited["matmul_fp32"].reason
    assert edited["matmul_fp16"].status == "passed"


def test_crash_and_invalid_json_through_the_whole_pipeline(course, cpu):
    lab = load_lab("01_gemm")
    variant(course, lab.name, "aborts", FIXTURE_DIR / "01_gemm-abort.py")
    broken = course.submitted("not-json", lab.name)
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text('{"cells": [')
    summary = pipeline.autograde(course, lab, profile=cpu, seed=SEED, students=["aborts", "not-json"], cell_timeout=60)
    assert summary.students == ["aborts", "not-json"]
    aborts, not_json = rows_for(course, "aborts", lab.name), rows_for(course, "not-json", lab.name)
    # nbgrader's kernel dies on the abort; the engine never runs it (it is not in a kernel).
    assert aborts["matmul_fp32"]["status"] == "not_a_kernel" and aborts["grouped_order"]["status"] == "passed"
    assert aborts["row_sum"]["status"] == "passed"  # another kernel of the same notebook
    assert {r["status"] for r in not_json.values()} == {"invalid_notebook", "needs_gpu"}
    assert "not valid JSON" in not_json["matmul_fp32"]["reason"]
    with Gradebook(course.db_url) as gb:
        kept = lab.item("grouped_order").points + lab.item("row_sum").points
        assert gb.find_submission(lab.name, "aborts").score == pytest.approx(kept)
        assert gb.find_submission(lab.name, "not-json").score == 0
    assert pipeline.feedback(course, lab, ["aborts"]) == []


def test_regrade_with_the_same_seed_gives_the_same_score(cpu, demo):
    course = demo["01_gemm"].course
    first = engine(course, cpu, "01_gemm", "buggy-k-remainder")
    again = engine(course, cpu, "01_gemm", "buggy-k-remainder")
    assert {k: (r.score, r.reason) for k, r in first.items()} == {k: (r.score, r.reason) for k, r in again.items()}


def test_speed_item_is_timed_where_no_student_python_runs(cpu, demo):
    """The GPU speed protocol, exercised on the CPU: the kernel child times candidate and baseline
    A/B interleaved, with only the extracted kernel of the student's."""
    params = {"size": 64, "min_speedup": 0.0, "warmup": 1, "reps": 3}
    labs = json.loads(json.dumps(cpu["labs"]))
    labs["01_gemm"]["matmul_speed"] = params
    profile = {**cpu, "speed_on_cpu": True, "labs": labs}
    result = engine(demo["01_gemm"].course, profile, "01_gemm", "reference")["matmul_speed"]
    assert result.status == "passed", result
    assert len(result.details["candidate_s"]) == 3 and len(result.details["baseline_s"]) == 3
    assert result.details["speedup"] > 0


def test_the_demo_class_scores_as_make_gpu_class_requires(demo):
    """make gpu-class's verdict (benchmarks/gpu_class.py) on this profile's demo class: what needs
    a GPU is left out; every other item must already score as the demos promise."""
    import importlib.util

    from autograder import records
    from autograder.submissions import demo_targets

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("gpu_class", os.path.join(root, "benchmarks", "gpu_class.py"))
    gpu_class = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_class)
    courses = {id(d.course): d.course for d in demo.values()}.values()
    graded = [r for course in courses for r in records.read_all(course.records)
              if r["student"] in gpu_class.planned_students(r["lab"])]
    assert {r["lab"] for r in graded} == set(all_labs())
    assert gpu_class.class_problems(graded, demo_targets) == []
