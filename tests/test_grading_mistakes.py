"""The labs' realistic mistakes beyond the demo class: each ``autograder/fixtures/<lab>-mistake-*.py``
is a submission the course's grader must mark down, as it does the demo's buggy students (``make
demo`` grades at most two per lab, to keep to its time; these are graded here, on the items
their mistake can reach, through the sandbox)."""

from pathlib import Path

import pytest

from autograder.engine.items import load_lab
from autograder.submissions import FIXTURE_DIR, parse_cells_file, variant
from test_grading_pipeline import engine

pytestmark = pytest.mark.slow
MISTAKES = sorted(FIXTURE_DIR.glob("[0-9][0-9]_*-mistake-*.py"))


def test_the_demo_class_keeps_at_most_two_mistakes_per_lab_and_the_rest_are_here():
    demo = Path(__file__).resolve().parents[1] / "autograder" / "demo"
    for lab in demo.iterdir():
        if lab.is_dir():
            assert 1 <= len(list(lab.glob("buggy-*.py"))) <= 2, lab.name
    assert len(MISTAKES) >= 8


@pytest.mark.parametrize("path", MISTAKES, ids=lambda p: p.stem)
def test_a_mistake_loses_points_only_where_it_reaches_with_reasons(course, cpu, path):
    lab = load_lab(path.name.split("-")[0])
    replaced = set(parse_cells_file(path))
    reached = {item.name for item in lab.items if replaced & {*item.cells, item.name}}
    assert reached, f"{path.name} replaces no cell an item executes"
    variant(course, lab.name, path.stem, path)
    results = engine(course, cpu, lab.name, path.stem, only=reached)
    lost = [r for r in results.values() if r.status not in ("passed", "needs_gpu")]
    assert lost, f"{path.stem} lost nothing: {[(r.item, r.status) for r in results.values()]}"
    assert all(r.reason and r.status != "not_graded" for r in lost), [(r.item, r.reason) for r in lost]
