"""The demo class of every lab graded on this GPU, sandboxed, in one command (make gpu-class).

On a GPU host:

1. checks that the host can grade as ``autograde`` does: the GPU usable (``device.host_problems``),
   a sandbox that starts (``bwrap.check``; a GPU image without bubblewrap gets a copy, see the
   README), a C compiler for Triton's launcher (``toolchain.check``), and the course's own Python
   packages (nbgrader, jupytext, ...), naming whatever is missing;
2. builds a fresh course in ``build/gpu-class/course`` and writes the demo class of each lab
   (``submissions.demo_students``: the reference, the untouched release and every buggy demo);
3. grades the class with ``batch.grade``, the code path of ``autograde``: the engine's children in
   the sandbox, one GPU resource per job, on this GPU's profile (``device.profile_name``);
   nbgrader's run of each notebook only with ``--nbgrader`` (the engine alone by default);
4. appends one row per graded item to ``benchmarks/results/gpu_class.csv``;
5. exits 1 where the class is not what the demos promise (:func:`class_problems`): a reference
   item below full marks, a buggy demo that passes every item its mistake reaches or loses points
   on one it cannot reach, an untouched release that scores, or any item ``not_graded``. Lab 08's
   GPU items on a host without RAPIDS are not graded, say so, and are left out of that verdict.

On a CPU host, or with ``--dry-run``, nothing is graded: it says what it would do and exits 0.

    PYTHONPATH=. python3 benchmarks/gpu_class.py [--labs 01,05] [--seed N] [--workers N] [--nbgrader] [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
COURSE = ROOT / "build" / "gpu-class" / "course"
COLUMNS = ["date", "gpu_name", "gpu_clocks_sm", "profile", "lab", "student", "item", "status", "score", "max_score",
           "speedup", "seconds"]
# What the grading path imports besides torch and Triton, which a GPU image may lack.
COURSE_MODULES = ("autograder.batch", "autograder.submissions", "autograder.progress")
# A machine without RAPIDS cannot time lab 08's GPU items; they say so and are left out of the verdict.
LEFT_OUT = re.compile(r"needs RAPIDS")
DEMO_STUDENTS = ("reference", "untouched")


def _bench_gpu():
    """benchmarks/gpu.py (make bench-gpu): the GPU's name and clocks come from the same query."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    return gpu


# --------------------------------------------------------------------------------------------
# The verdict and the rows (pure: unit-tested on the CPU with made-up records)


def _left_out(item: dict) -> bool:
    return not item.get("counted", True) or (item["status"] == "not_graded" and bool(LEFT_OUT.search(item["reason"])))


def class_problems(records: list[dict], targets) -> list[str]:
    """Where the graded class differs from what its demos promise, one line each. ``targets(lab,
    student)`` is the items a buggy demo's mistake can reach (``submissions.demo_targets``): the
    items that run a cell it replaces. A mistake can run without changing what an item checks (a
    naive variance passes the backward's check), so a buggy demo must lose at least one of them
    and nothing else, as ``tests/test_grading_pipeline.py`` asks of the CPU profile's demo."""
    problems = []
    for record in records:
        lab, student = record["lab"], record["student"]
        reached = set(targets(lab, student) or ()) if student.startswith("buggy-") else set()
        graded = [item for item in record["items"] if not _left_out(item)]
        for item in graded:
            where = f"{lab} {student} {item['item']}: {item['status']} {item['score']:g}/{item['max_score']:g}"
            reason = f" ({item.get('reason', '')[:200]})"
            if item["status"] == "not_graded":
                problems.append(f"{where}: not graded{reason}")
            elif student == "reference" and item["score"] < item["max_score"]:
                problems.append(f"{where}: the reference is below full marks{reason}")
            elif student == "untouched" and item["score"] > 0:
                problems.append(f"{where}: the untouched release scores")
            elif student.startswith("buggy-") and item["item"] not in reached and item["score"] < item["max_score"]:
                problems.append(f"{where}: loses points its mistake cannot reach{reason}")
        reached_graded = [item for item in graded if item["item"] in reached]
        if reached_graded and all(item["status"] == "passed" for item in reached_graded):
            problems.append(f"{lab} {student}: passes every item its mistake reaches "
                            f"({', '.join(item['item'] for item in reached_graded)})")
    return problems


def unharmed(records: list[dict], targets) -> list[str]:
    """The items a buggy demo's mistake reaches that it passes anyway: not a fault, but a GPU run
    that differs from the CPU's here is worth reading."""
    return [f"{record['lab']} {record['student']} {item['item']}" for record in records
            if record["student"].startswith("buggy-") for item in record["items"]
            if item["item"] in set(targets(record["lab"], record["student"]) or ()) and item["status"] == "passed"]


def class_rows(records: list[dict], *, gpu: dict[str, str], profile: str, date: str) -> list[dict]:
    """One row of ``gpu_class.csv`` per graded item."""
    rows = []
    for record in records:
        for item in record["items"]:
            speedup = (item.get("details") or {}).get("speedup")
            rows.append({"date": date, "gpu_name": gpu.get("gpu_name", ""), "gpu_clocks_sm": gpu.get("gpu_clocks_sm", ""),
                         "profile": profile, "lab": record["lab"], "student": record["student"], "item": item["item"],
                         "status": item["status"], "score": item["score"], "max_score": item["max_score"],
                         "speedup": "" if speedup is None else round(float(speedup), 4),
                         "seconds": item.get("wall_s", "")})
    return rows


def append_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


# --------------------------------------------------------------------------------------------
# The host


def planned_students(lab: str) -> list[str]:
    """The demo class of ``lab`` as ``submissions.demo_students`` writes it, without writing it."""
    return [*DEMO_STUDENTS, *sorted(p.stem for p in (ROOT / "autograder" / "demo" / lab).glob("buggy-*.py"))]


def missing_modules() -> list[str]:
    """The Python packages the grading path needs that cannot be imported here."""
    import importlib

    missing = []
    for module in COURSE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{exc.name or module} (imported by {module})")
    return missing


def describe_plan(labs: list, profile: str, host: str, args) -> str:
    """What a run would grade: every lab's students and items, and what each must score."""
    try:
        from autograder.submissions import demo_targets
    except ImportError:
        demo_targets = None
    lines = [f"make gpu-class, dry run ({host}): nothing is graded.",
             f"On a GPU host it would build a course in {COURSE.relative_to(ROOT)}, grade the demo class below with "
             f"batch.grade (the path of autograde: the engine's children sandboxed, one GPU per job, "
             f"{'with' if args.nbgrader else 'without'} nbgrader's run of each notebook) on {profile}, append one row "
             f"per item to {(RESULTS / 'gpu_class.csv').relative_to(ROOT)}, and exit 1 unless every reference item has "
             "full marks, every buggy demo loses points on some items its mistake reaches and on no other, the "
             "untouched release scores 0 and no item is not_graded.", ""]
    jobs = items = 0
    for lab in labs:
        students = planned_students(lab.name)
        speed = [it.name for it in lab.items if it.is_speed]
        lines.append(f"{lab.name}: {len(lab.items)} items ({', '.join(it.name for it in lab.items)}; timed: "
                     f"{', '.join(speed) or 'none'})")
        for student in students:
            if student == "reference":
                expect = "full marks on every item"
            elif student == "untouched":
                expect = "0 on every item (unanswered)"
            else:
                reached = demo_targets(lab.name, student) if demo_targets else None
                expect = (f"loses points on some of {', '.join(reached)}; full marks elsewhere" if reached
                          else "loses what its mistake reaches")
            lines.append(f"  {student}: {expect}")
        jobs += len(students)
        items += len(students) * len(lab.items)
    lines.append(f"\n{jobs} submissions, {items} graded items in all.")
    return "\n".join(lines)


def _labs(names: str) -> list:
    from autograder.engine.items import all_labs, load_lab

    return [load_lab(n) for n in names.split(",") if n] if names else list(all_labs().values())


def preflight(profile: dict) -> list[str]:
    """What keeps this GPU host from grading the class as ``autograde`` would, one line each."""
    from autograder.engine import bwrap, toolchain
    from fastdl_lab import device

    problems = list(device.host_problems(device.host_facts()))
    missing = missing_modules()
    if missing:
        problems.append("the course's Python packages are missing: " + ", ".join(missing) + " (install the "
                        "project with pip install -e ., or carry its wheels, see the README's 'On a GPU host')")
    try:
        bwrap.check()
    except bwrap.IsolationUnavailable as exc:
        problems.append(f"no sandbox: {exc} (on the lent GPU image: ../shared/gpu/carry-bwrap.sh, then "
                        "PATH=$PWD/.dev/bwrap/bin:$PATH)")
    problems += toolchain.find(shown=bwrap.shown()).problems(gpu=bool(profile.get("gpu")))
    return problems


def grade_class(labs: list, profile: dict, *, seed: int, workers: int | None, nbgrader: bool) -> list[dict]:
    """Build a fresh course, write the demo class and grade it as ``autograde`` does: the records."""
    import os

    from autograder import batch
    from autograder.course import Course, build, tool_env
    from autograder.progress import Progress, summary_lines
    from autograder.submissions import demo_students

    # nbgrader runs its tools by name (alembic): this interpreter's bin first, as autograde does.
    os.environ["PATH"] = tool_env()["PATH"]
    shutil.rmtree(COURSE, ignore_errors=True)
    course = Course(COURSE)
    build(course, [lab.name for lab in labs])
    jobs = [(lab.name, student) for lab in labs for student in demo_students(course, lab.name)]
    workers = workers or batch.default_workers(profile)
    print(f"grading {len(jobs)} submissions of {len(labs)} labs on the {profile['name']} profile with {workers} "
          "worker(s)", flush=True)
    progress = Progress(len(jobs))
    try:
        summary = batch.grade(course, jobs, profile=profile, seed=seed, workers=workers, execute=nbgrader,
                              progress=progress)
    finally:
        progress.close()
    records = list(summary.graded.values())
    print("\n".join(summary_lines(records)))
    for failure in summary.failures:
        print(f"  - {failure}")
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", default="", help="comma-separated labs (default: every lab)")
    parser.add_argument("--seed", type=int, default=None, help="the batch seed (default: a fresh one, printed)")
    parser.add_argument("--workers", type=int, default=None, help="grading workers (default: one per GPU)")
    parser.add_argument("--nbgrader", action="store_true", help="also run nbgrader's autograde of each notebook")
    parser.add_argument("--dry-run", action="store_true", help="say what would be graded, grade nothing")
    args = parser.parse_args(argv)

    from fastdl_lab import device

    labs = _labs(args.labs)
    if args.dry_run or not device.has_gpu():
        problems = device.host_problems(device.host_facts())
        if not args.dry_run and problems:
            print("make gpu-class: this host has an NVIDIA driver but cannot use the GPU:\n  " + "\n  ".join(problems))
            return 1
        host = f"this host's GPU, profile {device.profile_name()}" if device.has_gpu() else "no GPU on this host"
        print(describe_plan(labs, "the profile of the GPU it finds (autograder/profiles/: h100, h200, a100, t4, "
                                  "else default)", host, args))
        return 0

    from autograder import profiles
    from fastdl_lab.checks import fresh_seed

    profile = profiles.load(device.profile_name())
    problems = preflight(profile)
    if problems:
        print("make gpu-class: this GPU host cannot grade the class yet:\n  " + "\n  ".join(problems))
        return 1
    print(device.describe(), flush=True)
    seed = fresh_seed() if args.seed is None else args.seed
    started = time.monotonic()
    records = grade_class(labs, profile, seed=seed, workers=args.workers, nbgrader=args.nbgrader)
    gpu = _bench_gpu().gpu_state()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    append_rows(class_rows(records, gpu=gpu, profile=profile["name"], date=date), RESULTS / "gpu_class.csv")
    from autograder.submissions import demo_targets

    found = class_problems(records, demo_targets)
    passed_anyway = unharmed(records, demo_targets)
    if passed_anyway:
        print("reached by a buggy demo's mistake and passed anyway (compare with the CPU profile's demo):\n  "
              + "\n  ".join(passed_anyway))
    print(f"\n{len(records)} submissions graded in {time.monotonic() - started:.0f} s on {gpu.get('gpu_name')} "
          f"(seed {seed}); rows in {(RESULTS / 'gpu_class.csv').relative_to(ROOT)}")
    if found:
        print(f"{len(found)} item(s) differ from what the demo class promises:\n  " + "\n  ".join(found))
        return 1
    print("every reference item at full marks, every buggy demo losing points only where its mistake reaches, "
          "nothing not graded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
