"""Benchmark of the autograder: wall time to grade one submission of each lab, end to end.

Builds a throw-away course, writes the reference submission of every lab and times
``pipeline.autograde`` for it (nbgrader's run of the notebook beside the trusted engine's
sandboxed items), then appends one row per lab, with hardware columns, to
``benchmarks/results/grading.csv``:

- ``setup_s``: what a lab costs once per course and machine, made before the timed run: its
  scratch course (``jobs.prepare_scratch``, kept between batches) and, for a lab that builds C++,
  the precompiled torch/extension.h (``fastdl_lab.custom.pch``), and the fork servers the item
  children, nbgrader's run and its kernel are forked from (``autograder/engine/prefork.py``), once
  per grading process. Rows before this column existed counted the scratch course in
  ``submission_s`` and had no precompiled header;
- ``submission_s``: the ``autograde`` of one submission after that;
- ``nbgrader_s``, ``engine_s``: the two parts of the submission as its record times them. They
  overlap (nbgrader runs in one of the engine's item slots) in rows with ``setup_s``; before,
  ``engine_s`` was ``submission_s - nbgrader_s``;
- ``children``: ``all forked`` when the item children, nbgrader's own process and its kernel were
  forked from fork servers, ``forked`` when the item children and the kernel were (rows of
  2026-11-25, when nbgrader's process still started cold), ``forked items`` when only the item
  children were (rows of 2026-11-25 before the kernel was), ``cold`` when each started a fresh
  interpreter (``FASTDL_PREFORK=0``, a GPU profile; rows before this column existed are all cold);
- ``nth``: which grading of the lab this is in the grading process. The first pays for what a
  process measures once per lab (the reference children of memory items and memory worlds); with
  ``--again N`` the same submission is graded N more times, as later students of a class are.
  Rows before this column existed are all first gradings.

``--cells N`` also prints, for each lab, the N slowest cells of nbgrader's run of the notebook (from
the timing nbclient records in each executed cell): where a lab's share of nbgrader's time goes.

``--beside`` compares, on the same machine and course, nbgrader's run beside the engine's items
(as graded) with nbgrader's run first and the items after it (as graded before): both, in turn,
``--rounds`` times per lab after a warm-up, one row per run in ``grading_beside.csv``.

    python benchmarks/grading.py [--labs 01_gemm ...] [--again N] [--cells 5] [--beside [--rounds 2]] [--dry-run]
"""

import argparse
import json
import tempfile
import time
from datetime import datetime
from pathlib import Path

from autograder import jobs, pipeline, profiles
from autograder.course import Course, build
from autograder.engine import prefork
from autograder.engine.grade import grade_submission, start_fork_servers
from autograder.engine.items import all_labs
from autograder.submissions import make_submission, reference_solutions
from fastdl_lab import measure
from fastdl_lab.custom import pch, sources


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="*", help="labs to time (default: all)")
    parser.add_argument("--beside", action="store_true", help="nbgrader beside the items against nbgrader first")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each arrangement per lab (--beside)")
    parser.add_argument("--cells", type=int, default=0, metavar="N",
                        help="print the N slowest cells of nbgrader's run of each lab")
    parser.add_argument("--again", type=int, default=0, metavar="N",
                        help="grade each lab's submission N more times in the same process (column nth)")
    parser.add_argument("--dry-run", action="store_true", help="print the rows, record nothing")
    args = parser.parse_args(argv)
    labs = args.labs or list(all_labs())
    profile = profiles.load(None)
    if args.beside:
        rows = _beside(labs, profile, args.rounds)
        if not args.dry_run:
            print(f"appended {len(rows)} rows to {measure.append_results('grading_beside', rows)}")
        return
    rows = []
    for course, lab in _references(labs):
        started = time.monotonic()
        jobs.prepare_scratch(course, lab, course.root / ".setup")
        if any(item.torch_headers for item in all_labs()[lab].items):
            pch.ensure(sources.OPTIMISE)
        start_fork_servers(all_labs()[lab], profile)
        jobs.start_nbgrader_servers(course.student_package, profile)
        setup_s = time.monotonic() - started
        for nth in range(1, 2 + args.again):
            before = prefork.forked_total, prefork.kernels_total, prefork.trusted_total
            seconds, record, summary = _grade(course, lab, profile)
            rows.append({"lab": lab, "profile": profile["name"], "submission_s": round(seconds, 2),
                         "nbgrader_s": record["seconds"]["nbgrader"], "engine_s": record["seconds"]["engine"],
                         "score": sum(item["score"] for item in record["items"]), "problems": len(summary.failures),
                         "setup_s": round(setup_s, 2),
                         "children": _children(*(now > then for now, then in zip(
                             (prefork.forked_total, prefork.kernels_total, prefork.trusted_total), before))),
                         "nth": nth})
            print(rows[-1], flush=True)
        if args.cells:
            executed = json.loads(course.autograded("reference", lab).read_text(encoding="utf-8"))
            for seconds_, index, source in slowest_cells(executed, args.cells):
                print(f"  {seconds_:6.2f} s  cell {index}: {source}")
    if not args.dry_run:
        print(f"appended {len(rows)} rows to {measure.append_results('grading', rows)}")


def slowest_cells(executed: dict, n: int) -> list[tuple[float, int, str]]:
    """The ``n`` longest-running code cells of an executed notebook, longest first: (seconds, index,
    the start of its source), from the times nbclient records in each cell's metadata."""
    timed = []
    for index, cell in enumerate(executed.get("cells", [])):
        stamps = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            seconds = (datetime.fromisoformat(stamps["shell.execute_reply"])
                       - datetime.fromisoformat(stamps["iopub.execute_input"])).total_seconds()
            source = "".join(cell.get("source", "")).strip().replace("\n", " | ")
            timed.append((seconds, index, source[:70]))
    return sorted(timed, key=lambda row: -row[0])[:n]


def _children(items: bool, kernel: bool, nbgrader: bool) -> str:
    if items and kernel:
        return "all forked" if nbgrader else "forked"
    return "forked items" if items else "cold"


def _references(labs: list[str]):
    """A throw-away course with the reference submission of each lab: (course, lab) in turn."""
    with tempfile.TemporaryDirectory() as tmp:
        course = Course(Path(tmp))
        build(course, labs)
        for lab in labs:
            make_submission(course, lab, "reference", reference_solutions(course, lab))
            yield course, lab


def _grade(course: Course, lab: str, profile: dict):
    """Wall seconds of ``autograde`` for the reference, its record and the lab's summary."""
    started = time.monotonic()
    summary = pipeline.autograde(course, all_labs()[lab], profile=profile, seed=0, students=["reference"])
    seconds = time.monotonic() - started
    return seconds, json.loads((course.records / lab / "reference.json").read_text()), summary


def _nbgrader_first(*args, alongside=None, **kwargs):
    """``jobs.grade_submission`` as it was before nbgrader ran beside the items: nbgrader's run,
    then the items."""
    if alongside is not None:
        alongside()
    return grade_submission(*args, **kwargs)


def _beside(labs: list[str], profile: dict, rounds: int) -> list[dict]:
    rows = []
    for course, lab in _references(labs):
        _grade(course, lab, profile)  # the warm-up makes the scratch course and lab 09's precompiled header
        for run in range(rounds):
            for arrangement, grade in (("beside", grade_submission), ("nbgrader_first", _nbgrader_first)):
                jobs.grade_submission = grade
                try:
                    _, record, _ = _grade(course, lab, profile)
                finally:
                    jobs.grade_submission = grade_submission
                rows.append({"lab": lab, "profile": profile["name"], "arrangement": arrangement, "round": run,
                             "submission_s": record["seconds"]["total"], "nbgrader_s": record["seconds"]["nbgrader"]})
                print(rows[-1])
    return rows


if __name__ == "__main__":
    main()
