"""One score everywhere: formgrader's *Autograde* button grades through the trusted engine, and
the gradebook, the feedback, the CSV report and the CLI give a submission the same total, with
the points of items this hardware cannot grade (GPU speed items on the CPU) left out in each.

One submission is graded, once, as formgrader grades it: nbgrader's API (``NbGraderAPI.autograde``,
what the button's handler calls) in the course folder, with the course's own nbgrader_config.py.
The submission is hostile: it makes every cell of its notebook end in a float, which nbgrader
alone would read as partial credit for its test cells.

A lab rebuilt after grading keeps that total (nbgrader's generate_assignment alone would count the
left-out points again), feedback refuses a gradebook whose maximum the records do not give, and
the CSV's counted rows sum to the same total.
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from autograder import batch, cli, gradebook, hints, pipeline, profiles, records, tables
from autograder.course import build, copy_build
from autograder.engine.items import load_lab
from autograder.submissions import make_submission, reference_solutions, variant

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "adversarial" / "01_gemm-nbgrader-partial-credit.py"
LAB, STUDENT = "01_gemm", "float-tail"

# What formgrader's AutogradeHandler does, in the course folder with its nbgrader_config.py.
FORMGRADER_AUTOGRADE = """
import json, sys
from nbgrader.apps import NbGraderAPI
from nbgrader.apps.nbgraderapp import NbGraderApp
from nbgrader.coursedir import CourseDirectory
app = NbGraderApp()
app.load_config_file()
coursedir = CourseDirectory(config=app.config)
api = NbGraderAPI(coursedir, config=app.config)
print(json.dumps(api.autograde(sys.argv[1], sys.argv[2])))
"""


@pytest.fixture(scope="module")
def graded(course, tmp_path_factory):
    copy = copy_build(course, tmp_path_factory.mktemp("formgrader"))
    # A lab graded once already: on the CPU its speed item is worth 0 in the gradebook from then on,
    # and nbgrader's own checks of the locked cells must still pass.
    make_submission(copy, LAB, "earlier", reference_solutions(copy, LAB))
    batch.grade(copy, [(LAB, "earlier")], profile=profiles.load("cpu"), seed=1, execute=False, only=["matmul_speed"])
    with Gradebook(copy.db_url) as gb:
        assert gb.find_grade_cell("matmul_speed", LAB, LAB).max_score == 0
    variant(copy, LAB, STUDENT, FIXTURE)
    done = subprocess.run([sys.executable, "-c", FORMGRADER_AUTOGRADE, LAB, STUDENT], cwd=copy.root,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["success"], (answer.get("log", "")[-3000:], answer.get("error", "")[-3000:])
    # The button shows a spinner; the formgrader's log says what runs and how long it took.
    head = f"autograde of {LAB} for {STUDENT}"
    assert f"{head}: started, with the trusted engine (usually " in answer["log"], answer["log"][-3000:]
    assert re.search(rf"{head}, [\d.]+ s: \[1/1\] {LAB} {STUDENT}: ", answer["log"]), answer["log"][-3000:]
    done_line = rf"{head}: done in [\d.]+ s \(the submission [\d.]+ s of it: "
    assert re.search(done_line, answer["log"]), answer["log"][-3000:]
    return copy


def test_formgrader_autograde_ends_with_the_engines_scores(graded):
    lab = load_lab(LAB)
    record = json.loads((graded.records / LAB / f"{STUDENT}.json").read_text())
    verdicts = {item["item"]: item for item in record["items"]}
    assert verdicts["grouped_order"]["status"] == "failed"
    assert verdicts["matmul_fp32"]["status"] == "passed"
    assert verdicts["matmul_speed"]["status"] == "needs_gpu"
    with Gradebook(graded.db_url) as gb:
        for item in lab.items:
            grade = gb.find_grade(item.name, LAB, LAB, STUDENT)
            engine = verdicts[item.name]["score"] if verdicts[item.name]["counted"] else 0.0
            # nbgrader alone would have given the float tail 1.0 x points and the speed item full marks
            assert grade.score == pytest.approx(engine), item.name
            assert grade.auto_score == pytest.approx(engine), item.name
            assert not grade.needs_manual_grade
        speed = gb.find_grade_cell("matmul_speed", LAB, LAB)
        assert speed.max_score == 0  # left out of this profile's total, for every student


def test_gradebook_feedback_csv_and_cli_totals_agree(graded):
    lab = load_lab(LAB)
    counted = sum(item.points for item in lab.items if not item.is_speed)
    left_out = sum(item.points for item in lab.items if item.is_speed)
    rows = [r for r in pipeline.report_rows(graded) if r["student"] == STUDENT]
    total = pipeline.totals(rows)[(STUDENT, LAB)]
    assert total["max"] == counted and total["left_out"] == left_out
    with Gradebook(graded.db_url) as gb:
        submission = gb.find_submission(LAB, STUDENT)
        assert (submission.score, submission.max_score) == pytest.approx((total["score"], total["max"]))
    assert pipeline.feedback(graded, lab, [STUDENT]) == []
    html = (graded.feedback_dir(STUDENT, LAB) / f"{LAB}.html").read_text()
    header = re.search(rf"{LAB} \(Score: ([\d.]+) / ([\d.]+)\)", html)
    assert header and (float(header[1]), float(header[2])) == pytest.approx((total["score"], total["max"]))
    assert f"{left_out:g} points left out of the total" in html
    table = tables.grade_table(rows)
    assert f"{tables.score_text(total['score'])}/{tables.score_text(total['max'])}" in table and "need a GPU" in table


def test_a_grade_cells_checksum_follows_its_points(course):
    """grade_cell_checksum gives nbgrader's own checksum of a grade cell at the maximum the gradebook
    holds (full points, or 0 where a profile left the item out), and another one at other points."""
    with Gradebook(course.db_url) as gb:
        for item in load_lab(LAB).items:
            stored = gb.find_source_cell(item.name, LAB, LAB).checksum
            points = gb.find_grade_cell(item.name, LAB, LAB).max_score
            assert gradebook.grade_cell_checksum(gb, LAB, item.name, points) == stored, item.name
            assert gradebook.grade_cell_checksum(gb, LAB, item.name, points + 1) != stored


@pytest.fixture(scope="module")
def full_marks(course, cpu, tmp_path_factory):
    """Lab 01 graded by the engine alone (no nbgrader run) for one student who answers every item as
    the reference does: on the CPU the speed item is left out of the total."""
    copy = copy_build(course, tmp_path_factory.mktemp("rebuild"))
    make_submission(copy, LAB, "ann", reference_solutions(copy, LAB))
    summary = batch.grade(copy, [(LAB, "ann")], profile=cpu, seed=5, execute=False)
    assert summary.failures == []
    return copy


def cli_total(course, student: str) -> tuple[float, float]:
    """The total the CLI's table and the dashboard show, from the grading records."""
    total = pipeline.totals([r for r in pipeline.report_rows(course) if r["student"] == student])[(student, LAB)]
    return total["score"], total["max"]


def exported_total(course, student: str, folder: Path) -> tuple[float, float]:
    """What `nbgrader export` writes for ``student``'s submission of the lab."""
    target = folder / "grades.csv"
    done = course.nbgrader("export", "--to", str(target))
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [r for r in csv.DictReader(target.open()) if (r["assignment"], r["student_id"]) == (LAB, student)]
    return float(row["score"]), float(row["max_score"])


def feedback_total(course, student: str) -> tuple[float, float]:
    html = (course.feedback_dir(student, LAB) / f"{LAB}.html").read_text()
    header = re.search(rf"{LAB} \(Score: ([\d.]+) / ([\d.]+)\)", html)
    assert header, "no score in the feedback's header"
    return float(header[1]), float(header[2])


def test_a_rebuild_keeps_the_graded_maximum_in_feedback_and_export(full_marks, tmp_path):
    lab = load_lab(LAB)
    counted = sum(item.points for item in lab.items if not item.is_speed)
    assert cli_total(full_marks, "ann") == (counted, counted)
    build(full_marks, [LAB])
    with Gradebook(full_marks.db_url) as gb:
        assert gb.find_grade_cell("matmul_speed", LAB, LAB).max_score == 0
    assert pipeline.feedback(full_marks, lab, ["ann"]) == []
    assert feedback_total(full_marks, "ann") == pytest.approx((counted, counted))
    assert exported_total(full_marks, "ann", tmp_path) == pytest.approx((counted, counted))
    # the stored checksum follows the kept maximum, or nbgrader's next autograde of the lab would fail
    with Gradebook(full_marks.db_url) as gb:
        stored = gb.find_source_cell("matmul_speed", LAB, LAB).checksum
        assert gradebook.grade_cell_checksum(gb, LAB, "matmul_speed", 0) == stored


def test_feedback_refuses_a_maximum_the_records_do_not_give(full_marks, monkeypatch, capsys):
    lab = load_lab(LAB)
    counted = sum(item.points for item in lab.items if not item.is_speed)
    every = sum(item.points for item in lab.items)
    # What a build did before it restored the maxima, and what nbgrader's own command still does.
    done = full_marks.nbgrader("generate_assignment", LAB, "--force", "--CourseDirectory.create_assignment=True")
    assert done.returncode == 0, done.stderr[-3000:]
    html = full_marks.feedback_dir("ann", LAB) / f"{LAB}.html"
    html.unlink(missing_ok=True)
    with pytest.raises(gradebook.MaximumMismatch) as refused:
        pipeline.feedback(full_marks, lab, ["ann"])
    message = str(refused.value)
    assert f"the gradebook counts {LAB} out of {every:g} points, ann's record out of {counted:g}" in message
    assert f"matmul_speed: {lab.item('matmul_speed').points:g} in the gradebook, 0 in the records" in message
    assert message.endswith(f": {hints.autograder(f'build {LAB}')}")
    assert not html.exists()

    monkeypatch.setenv("PATH", os.environ["PATH"])  # the CLI puts its bin first
    root = str(full_marks.root)
    assert cli.main(["--course", root, "feedback", LAB]) == 2
    err = capsys.readouterr().err
    assert f"no feedback written for {LAB}:" in err and f": {hints.autograder(f'--course {root} build {LAB}')}" in err
    assert not html.exists()
    # the command it names puts it right, without a regrade
    assert cli.main(["--course", root, "build", LAB]) == 0
    assert cli.main(["--course", root, "feedback", LAB]) == 0
    assert feedback_total(full_marks, "ann") == pytest.approx((counted, counted))


def test_the_csvs_counted_rows_sum_to_the_total(full_marks, tmp_path):
    lab = load_lab(LAB)
    csv_path, _ = pipeline.write_report(full_marks, tmp_path / "report.csv")
    with csv_path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if (r["student"], r["lab"]) == ("ann", LAB)]
    assert [r["item"] for r in rows] == [item.name for item in lab.items] + [pipeline.TOTAL_ITEM]
    counted = [r for r in rows if r["counted"] == "yes"]
    assert [r["item"] for r in rows if r["counted"] == "no"] == [item.name for item in lab.items if item.is_speed]
    summed = (sum(float(r["score"]) for r in counted), sum(float(r["max_score"]) for r in counted))
    (total,) = [r for r in rows if r["status"] == pipeline.TOTAL_STATUS]
    assert (float(total["score"]), float(total["max_score"])) == pytest.approx(summed)
    assert summed == pytest.approx(cli_total(full_marks, "ann"))
    assert summed == pytest.approx(exported_total(full_marks, "ann", tmp_path))
    assert summed[0] == summed[1]  # full marks: every counted point


def test_records_of_two_profiles_ask_for_a_regrade_not_a_rebuild(full_marks, tmp_path):
    """A lab graded on the CPU for one student and on a GPU for another has no one maximum that both
    records give: feedback names the regrade on one profile (the latest grading's)."""
    lab = load_lab(LAB)
    copy = copy_build(full_marks, tmp_path / "course")
    shutil.copytree(full_marks.records, copy.records)
    (ann,) = records.read_lab(copy.records, LAB)
    ann_file = copy.records / LAB / "ann.json"
    ann_file.write_text(json.dumps({**ann, "graded_at": "2026-01-01T00:00:00Z"}))  # graded before bob
    on_gpu = [{**verdict, "counted": True} for verdict in ann["items"]]
    records.write(copy.records, LAB, "bob", profile="h100", seed=1, items=on_gpu, nbgrader={})
    gradebook.check_maxima(copy.db_url, lab, records.read_lab(copy.records, LAB), ["ann"])  # ann's record agrees
    with pytest.raises(gradebook.MaximumMismatch) as refused:
        gradebook.check_maxima(copy.db_url, lab, records.read_lab(copy.records, LAB), ["bob"])
    assert "disagree on matmul_speed (graded on the cpu and h100 profiles)" in str(refused.value)
    assert refused.value.command == ["autograde", LAB, "--profile", "h100"]
