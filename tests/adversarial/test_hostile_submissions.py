"""Hostile submissions, graded by the trusted engine exactly as a class is: each ends with 0 points
or a named flag, and leaves nothing behind.

The fixtures are hostile code: they read, write, kill and flood whatever they can reach. Grade
them only through the sandbox, as this test does, never with ``isolated=False``.

Every ``<lab>-<cheat>.py`` beside this file is a cells file (``# %% grade_id=...``) whose first line
says what the grader must answer: ``# expect: item=status[|status] ...``. The submission is the
reference with those cells replaced, so every other cell is honest and only the cheat can fail.
``partial`` means "less than full marks"; every other status means a score of 0.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from autograder.engine.grade import grade_submission
from autograder.records import MAX_REASON_CHARS
from autograder.engine.items import load_lab
from autograder.submissions import variant
from fastdl_lab.custom import pch, sources

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
FIXTURES = sorted(HERE.glob("[0-9][0-9]_*-*.py"))
EXPECT = re.compile(r"^# expect: (.+)$")
PWNED = Path("/tmp/fastdl-adversarial-pwned")
DAEMON = "fastdl-adversarial-daemon"
# Small inputs and short limits: a hostile run should end in seconds, not in the real profile's minutes.
WALL_S = 25
MATMUL_SPEED = {"size": 64, "min_speedup": 0.5, "warmup": 1, "reps": 3}
# Lab 06's loop trains for real: one warm-up and three samples are enough to exercise the protocol.
LOOP_SPEED = {"items": 128, "steps": 4, "warmup": 1, "reps": 3, "min_speedup": 0.0}


def expectations(path: Path) -> dict[str, set[str]]:
    match = EXPECT.match(path.read_text().splitlines()[0])
    assert match, f"{path.name}: first line must be '# expect: item=status ...'"
    return {item: set(statuses.split("|")) for item, statuses in
            (pair.split("=") for pair in match.group(1).split())}


def profile_for(cpu: dict) -> dict:
    labs = {name: dict(items) for name, items in cpu.get("labs", {}).items()}
    labs.setdefault("01_gemm", {})["matmul_speed"] = MATMUL_SPEED
    loop = labs.setdefault("06_data", {})
    loop["loop_speed"] = {**loop.get("loop_speed", {}), **LOOP_SPEED}
    return {**cpu, "limits": {**cpu["limits"], "wall_s": WALL_S}, "speed_on_cpu": True, "labs": labs}


def _processes_named(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_there_is_a_hostile_submission_for_every_lab_and_enough_of_them():
    labs = {p.name.split("-")[0] for p in FIXTURES}
    assert labs >= {"00_measure", "01_gemm", "02_fusion", "03_layernorm", "05_attention", "07_distributed"}
    assert len(FIXTURES) >= 30


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.stem)
def test_hostile_submission_gets_nothing(course, cpu, fixture):
    lab = fixture.name.split("-")[0]
    expected = expectations(fixture)
    PWNED.unlink(missing_ok=True)
    for folder in (course.records, course.root):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fastdl-adversarial-canary.json").write_text("{}")
    # A run journal (autograder/journal.py): what --resume trusts to skip a submission.
    (course.root / "runs").mkdir(exist_ok=True)
    (course.root / "runs" / "fastdl-adversarial-canary.jsonl").write_text("")
    before = {p: p.stat().st_mtime_ns for p in course.root.rglob("*") if p.is_file()}
    # The precompiled torch/extension.h every C++ build of every student shares (lab 09).
    shared = pch.ensure(sources.OPTIMISE) if lab == "09_custom_ops" else None
    shared_before = {p: p.stat().st_mtime_ns for p in shared.rglob("*")} if shared else {}
    student = f"adversary-{fixture.stem}"
    path = variant(course, lab, student, fixture)
    results = {r.item: r for r in grade_submission(
        load_lab(lab), path, release=course.release(lab), profile=profile_for(cpu), seed=99,
        student_package=course.student_package, only=set(expected))}
    for item, statuses in expected.items():
        result = results[item]
        assert result.status in statuses, f"{item}: {result.status} ({result.reason})"
        if "partial" in statuses:
            assert result.score < result.max_score
        else:
            assert result.score == 0, f"{item} scored {result.score}: {result.reason}"
        assert result.reason, f"{item}: a verdict without a reason"
        assert len(result.reason) <= MAX_REASON_CHARS
    # Nothing outside the sandbox was written, planted or left running.
    assert not PWNED.exists()
    assert not list((Path(__file__).resolve().parents[2] / "autograder" / "labs").glob("lab99_*"))
    changed = [p for p, mtime in before.items() if p.exists() and p.stat().st_mtime_ns != mtime
               and student not in p.parts]
    assert not changed, f"files of the course changed: {changed[:3]}"
    if shared:
        assert {p: p.stat().st_mtime_ns for p in shared.rglob("*")} == shared_before
    assert _processes_named(DAEMON) == []


def test_the_readme_lists_every_hostile_submission_with_its_expected_verdict():
    readme = (HERE.parents[1] / "README.md").read_text()
    assert f"hostile submissions for every lab ({len(FIXTURES)} in all)" in readme
    for fixture in FIXTURES:
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{fixture.stem}` |")), None)
        assert row, f"README's security table has no row for {fixture.stem}"
        for item, statuses in expectations(fixture).items():
            assert f"{item}: {'/'.join(sorted(statuses))}" in row, f"{fixture.stem}: README shows another verdict"


def test_spoiled_float_weights_leave_the_ptq_baseline_alone(course, cpu):
    """Lab 09's QAT child receives the float weights the parent trained for the item's inputs. What
    the child does to its copy does not reach the PTQ figure the verdict compares against: it is the
    parent's PTQ of the float model of the same hidden seed, computed here again from scratch."""
    from autograder import profiles
    from autograder.engine.grade import item_seed
    from fastdl_lab.quant import training

    lab = load_lab("09_custom_ops")
    item = lab.item("qat_beats_ptq")
    profile = profile_for(cpu)
    path = variant(course, lab.name, "adversary-qat-baseline", HERE / "09_custom_ops-qat-spoils-float-weights.py")
    [result] = grade_submission(lab, path, release=course.release(lab.name), profile=profile, seed=99,
                                student_package=course.student_package, only={item.name})
    assert result.status == "failed" and result.score == 0, result.reason
    inputs = item.make_inputs(item_seed(99, item.name), profiles.item_params(profile, lab.name, item.name))
    task = training.make_task(inputs["seed"])
    honest = training.accuracy(training.ptq(training.train_float(inputs["seed"]), inputs["bits"], task.train[0]),
                               task.test)
    assert result.details["ptq"] == honest > 0.4
    assert result.details["qat"] < honest
