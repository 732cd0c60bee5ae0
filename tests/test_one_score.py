"""One score everywhere: formgrader's *Autograde* button grades through the trusted engine, and
the gradebook, the feedback, the CSV report and the CLI give a submission the same total, with
the points of items this hardware cannot grade (GPU speed items on the CPU) left out in each.

One submission is graded, once, as formgrader grades it: nbgrader's API (``NbGraderAPI.autograde``,
what the button's handler calls) in the course folder, with the course's own nbgrader_config.py.
The submission is hostile: it makes every cell of its notebook end in a float, which nbgrader
alone would read as partial credit for its test cells.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from autograder import batch, gradebook, pipeline, profiles, tables
from autograder.course import copy_build
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
