"""``python -m autograder``: build the course, autograde, feedback, report, demo."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from autograder import gradebook, pipeline, profiles
from autograder.course import ROOT, Course, build
from autograder.engine.items import all_labs, load_lab


def _course(args) -> Course:
    return Course(Path(args.course), args.db_url) if args.course else Course.default(args.db_url)


def _checked(course: Course) -> Course:
    """``course``, once its gradebook answers: a database that is down stops the command before
    anything is built or graded, not with one failure per student."""
    course.check_gradebook()
    return course


def _seed(args) -> int:
    from fastdl_lab.checks import fresh_seed

    return args.seed if args.seed is not None else fresh_seed()


def _shown(text: str) -> str:
    """``text`` on one terminal line: student folder names and output must not move the cursor,
    recolour or add rows to what the instructor reads."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'student':<22} {'lab':<13} {'item':<20} {'score':>9}  {'status':<16} reason"]
    for r in rows:
        score = f"{r['score']:g}/{r['max_score']:g}"
        reason = _shown(r["reason"][:90])
        lines.append(f"{_shown(r['student']):<22} {r['lab']:<13} {r['item']:<20} {score:>9}  {r['status']:<16} {reason}")
    lines.append("")
    for (student, lab), t in sorted(pipeline.totals(rows).items()):
        note = f"  ({t['left_out']:g} points need a GPU: left out of the total)" if t["left_out"] else ""
        lines.append(f"total {_shown(student):<22} {lab:<13} {t['score']:g}/{t['max']:g}{note}")
    return "\n".join(lines)


def _print_failures(failures: list[str]) -> None:
    if failures:
        print(f"\n{len(failures)} problem(s) outside the grades (the grades above stand):")
        for f in failures:
            print(f"  - {_shown(f)}")


def cmd_build(args) -> int:
    course = _checked(_course(args))
    built = build(course, args.labs or None)
    print(f"built {', '.join(built)} in {course.root} (gradebook: {gradebook.masked(course.db_url)})")
    return 0


def cmd_autograde(args) -> int:
    course = _checked(_course(args))
    lab = load_lab(args.lab)
    summary = pipeline.autograde(course, lab, profile=profiles.load(args.profile), seed=_seed(args),
                                 students=args.student or None, cell_timeout=args.cell_timeout,
                                 isolated=not args.unsafe_no_isolation)
    rows = [r for r in pipeline.report_rows(course) if r["lab"] == lab.name and r["student"] in summary.students]
    print(format_table(rows))
    _print_failures(summary.failures)
    return 0


def cmd_feedback(args) -> int:
    course = _checked(_course(args))
    lab = load_lab(args.lab)
    failures = pipeline.feedback(course, lab, args.student or None)
    print(f"feedback for {lab.name} in {course.root / 'feedback'}")
    _print_failures(failures)
    return 0


def cmd_report(args) -> int:
    if not (args.csv or args.html):
        args.report_parser.error("say what to write: --csv FILE, --html FILE, or both")
    course = _course(args)
    if args.csv:
        csv_path, record_path = pipeline.write_report(course, Path(args.csv))
        print(f"wrote {csv_path} and {record_path}")
    if args.html:
        # Imported here: matplotlib is needed by this command only.
        from autograder import dashboard, records

        print(f"wrote {dashboard.write_html(records.read_all(course.records), Path(args.html))}")
    return 0


def cmd_demo(args) -> int:
    from autograder.submissions import demo_students

    started = time.monotonic()
    demo = ROOT / "build" / "demo"
    course = _checked(Course(Path(args.course) if args.course else demo / "course", args.db_url))
    labs = [load_lab(name).name for name in args.labs] if args.labs else list(all_labs())
    build(course, labs)
    failures, timings = [], []
    for lab in labs:
        students = demo_students(course, lab)
        spec = load_lab(lab)
        summary = pipeline.autograde(course, spec, profile=profiles.load(args.profile), seed=_seed(args),
                                     students=students, isolated=not args.unsafe_no_isolation)
        failures += summary.failures
        timings.append(f"{lab}: " + ", ".join(f"{s} {t:.0f} s" for s, t in summary.seconds.items()))
        failures += pipeline.feedback(course, spec, students)
    csv_path, record_path = pipeline.write_report(course, demo / "report.csv")
    print(format_table(pipeline.report_rows(course)))
    _print_failures(failures)
    print(f"\nreport: {csv_path}\nrecords: {record_path}\nfeedback: {course.root / 'feedback'}")
    print("grading time per submission (nbgrader + engine): " + "; ".join(timings))
    print(f"demo took {time.monotonic() - started:.0f} s")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autograder", description=__doc__)
    p.add_argument("--course", help="course folder (default: build/course, or FASTDL_COURSE_DIR)")
    p.add_argument("--db-url", help="the gradebook's database URL, e.g. postgresql://USER@HOST/DB "
                                    f"(default: {gradebook.URL_VAR}, else gradebook.db in the course folder)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("build", help="source notebooks, student release and student package")
    s.add_argument("labs", nargs="*")
    s.set_defaults(func=cmd_build)

    grading = argparse.ArgumentParser(add_help=False)
    grading.add_argument("--profile", choices=profiles.available(), help="hardware profile (default: this machine's)")
    grading.add_argument("--seed", type=int, help="reuse a recorded seed to regrade identically (default: secret, fresh)")
    grading.add_argument("--unsafe-no-isolation", action="store_true",
                         help="grade where student code cannot be isolated (no bubblewrap or user namespaces); "
                              "every row of the report says so")

    s = sub.add_parser("autograde", parents=[grading], help="nbgrader autograde, then the trusted engine")
    s.add_argument("lab")
    s.add_argument("--student", action="append", help="grade only this student (repeatable)")
    s.add_argument("--cell-timeout", type=int, help="nbgrader per-cell timeout in seconds")
    s.set_defaults(func=cmd_autograde)

    s = sub.add_parser("feedback", help="HTML feedback with the trusted verdicts, no hidden tests")
    s.add_argument("lab")
    s.add_argument("--student", action="append")
    s.set_defaults(func=cmd_feedback)

    s = sub.add_parser("report", help="export grades (CSV) and/or an instructor's dashboard (HTML)")
    s.add_argument("--csv", metavar="FILE", help="one row per student, lab and item: student, lab, item, "
                                                 "score, max_score, status, reason (records beside it)")
    s.add_argument("--html", metavar="FILE", help="one offline page: score distributions, totals, common "
                                                  "failure reasons, speed-ups per hardware profile, grading time")
    s.set_defaults(func=cmd_report, report_parser=s)

    s = sub.add_parser("demo", parents=[grading], help="build, grade the bundled demo submissions, report")
    s.add_argument("labs", nargs="*")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    from autograder.engine.bwrap import IsolationUnavailable

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except gradebook.GradebookUnavailable as exc:
        print(f"stopped before any work: {exc}", file=sys.stderr)
        return 2
    except IsolationUnavailable as exc:
        print(f"cannot grade: student code cannot be isolated on this machine: {exc}.\n"
              "Install bubblewrap (apt-get install bubblewrap; `make demo` does it), or pass "
              "--unsafe-no-isolation to grade anyway with every row marked unsafe.", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
