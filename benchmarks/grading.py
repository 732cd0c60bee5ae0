"""Benchmark of the autograder: wall time to grade one submission of each lab, end to end.

Builds a throw-away course, writes the reference submission of every lab and times
``pipeline.autograde`` for it (nbgrader's execution of the notebook plus the trusted engine's
sandboxed items), then appends one row per lab, with hardware columns, to
``benchmarks/results/grading.csv``. Budget on the 2-core CPU machines: 60 s per lab-01 submission.

    python benchmarks/grading.py [--labs 01_gemm ...] [--dry-run]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from autograder import pipeline, profiles
from autograder.course import Course, build
from autograder.engine.items import all_labs
from autograder.submissions import make_submission, reference_solutions
from fastdl_lab import measure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="*", help="labs to time (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the rows, record nothing")
    args = parser.parse_args(argv)
    labs = args.labs or list(all_labs())
    profile = profiles.load(None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        course = Course(Path(tmp))
        build(course, labs)
        for lab in labs:
            make_submission(course, lab, "reference", reference_solutions(course, lab))
            started = time.monotonic()
            summary = pipeline.autograde(course, all_labs()[lab], profile=profile, seed=0, students=["reference"])
            seconds = time.monotonic() - started
            record = pipeline.report_rows(course)
            score = sum(r["score"] for r in record if r["lab"] == lab)
            nbgrader_s = _nbgrader_seconds(course, lab)
            rows.append({"lab": lab, "profile": profile["name"], "submission_s": round(seconds, 2),
                         "nbgrader_s": nbgrader_s, "engine_s": round(seconds - nbgrader_s, 2), "score": score,
                         "problems": len(summary.failures)})
            print(rows[-1])
    if not args.dry_run:
        print(f"appended {len(rows)} rows to {measure.append_results('grading', rows)}")


def _nbgrader_seconds(course: Course, lab: str) -> float:
    record = json.loads((course.records / lab / "reference.json").read_text())
    return float(record["nbgrader"]["seconds"])


if __name__ == "__main__":
    main()
