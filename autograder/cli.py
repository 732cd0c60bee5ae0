"""``python -m autograder``: build the course, import the roster, autograde, feedback, report, demo."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from pathlib import Path

from autograder import batch, gradebook, hints, journal, pipeline, profiles, tables
from autograder.course import COURSE_ID, ROOT, Course, build, tool_env
from autograder.engine.items import all_labs, load_lab
from autograder.progress import Progress, shown, summary_lines
from fastdl_lab import device


# The first word of every line a self-check prints when it ran without the sandbox.
UNSAFE_MARK = "UNSAFE  "


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


def _failure_lines(failures: list[str], width: int = tables.WIDTH) -> list[str]:
    lines = []
    if failures:
        lines.append(f"\n{len(failures)} problem(s) outside the grades (the grades above stand):")
        for f in failures:
            first, *rest = tables.wrapped(f, lines=3, indent="    ", note="(in the records)", width=width) or ["    "]
            lines += ["  - " + first.lstrip(), *rest]
    return lines


def _print_failures(failures: list[str]) -> None:
    if failures:
        print("\n".join(_failure_lines(failures)))


def _course_options(args) -> list[str]:
    """The options that point a printed command at the same course and gradebook (a password masked)."""
    options = ["--course", str(Path(args.course).resolve())] if args.course else []
    return options + (["--db-url", gradebook.masked(args.db_url)] if args.db_url else [])


def _course_option(args) -> str:
    """``_course_options`` as the start of a printed command line ("" where there are none)."""
    options = _course_options(args)
    return shlex.join(options) + " " if options else ""


def _print_seed(command: str, seed: int, profile: dict) -> None:
    """The run's seed with the command that regrades it with the same hidden inputs."""
    again = hints.autograder(f"{command} --seed {seed} --profile {profile['name']}")
    print(f"\nseed {seed} on the {profile['name']} profile; regrade identically with:\n  {again}")


def cmd_build(args) -> int:
    course = _checked(_course(args))
    built = build(course, args.labs or None)
    print(f"built {', '.join(built)} in {course.root} (gradebook: {gradebook.masked(course.db_url)})")
    return 0


def _grade(course: Course, jobs: list[tuple[str, str]], args, *, profile: dict, seed: int,
           run: journal.Run | None = None) -> batch.BatchSummary:
    """Grade ``jobs`` with the command line's choice of workers, showing progress as they finish; a
    resumed ``run`` grades as it was started (with or without nbgrader, the same items)."""
    todo = run.remaining if run else jobs
    options = run.options if run else {"execute": not args.engine_only, "only": getattr(args, "item", None),
                                       "cell_timeout": getattr(args, "cell_timeout", None)}
    workers = args.workers if args.workers is not None else batch.default_workers(profile)
    where = f"on the cluster at {args.scheduler}" if args.scheduler else f"with {min(workers, len(todo))} worker(s)"
    print(f"grading {len(todo)} submission(s) {where}", flush=True)
    progress = Progress(len(todo))
    try:
        return batch.grade(course, jobs, profile=profile, seed=seed, workers=workers, scheduler=args.scheduler,
                           cell_timeout=options.get("cell_timeout"), isolated=not args.unsafe_no_isolation,
                           execute=options.get("execute", True), only=options.get("only"),
                           only_per_job=options.get("only_per_job"), run=run,
                           progress=progress, stage=progress.note)
    finally:
        progress.close()


def cmd_autograde(args) -> int:
    course = _checked(_course(args))
    lab = load_lab(args.lab)
    run = None
    if args.resume:
        if args.student or args.seed is not None or args.profile or args.item or args.engine_only:
            args.autograde_parser.error("--resume grades the rest of the last run as it was started: its students, "
                                        "seed, profile and items")
        run = journal.latest_unfinished(course.root, {lab.name})
        if run is None:
            print(f"nothing to resume: the last run of {lab.name} finished (or none was started)")
            return 0
        profile, seed, jobs = profiles.load(run.profile), run.seed, run.jobs
        print(f"resuming run {run.run_id}: {len(run.final)} of {len(jobs)} already graded")
    else:
        profile, seed = profiles.load(args.profile), _seed(args)
        jobs = [(lab.name, student) for student in args.student or course.students(lab.name)]
    summary = _grade(course, jobs, args, profile=profile, seed=seed, run=run)
    students = {student for _, student in summary.jobs}
    rows = [r for r in pipeline.report_rows(course) if r["lab"] == lab.name and r["student"] in students]
    print(tables.grade_table(rows))
    print("\n".join(summary_lines(list(summary.graded.values()))))
    _print_failures(summary.failures)
    _print_seed(f"{_course_option(args)}autograde {lab.name}", seed, profile)
    return 0


def cmd_feedback(args) -> int:
    course = _checked(_course(args))
    lab = load_lab(args.lab)
    made = Progress(len(args.student or course.students(lab.name)), desc="feedback")
    try:
        try:
            failures = pipeline.feedback(course, lab, args.student or None,
                                         progress=lambda done, total, text: made.line(done, total, shown(text)))
        finally:
            made.close()
    except gradebook.MaximumMismatch as exc:
        print(f"no feedback written for {lab.name}: {exc.text(_course_options(args))}", file=sys.stderr)
        return 2
    print(f"feedback for {lab.name} in {course.root / 'feedback'}")
    _print_failures(failures)
    return 0


def report_paths(course: Course) -> dict[str, Path]:
    """Where reports go unless told: beside the course folder (build/ for the default course),
    never the directory the command happens to run in."""
    return {"csv": course.root.parent / "report.csv", "html": course.root.parent / "dashboard.html"}


def cmd_report(args) -> int:
    if not (args.csv or args.html):
        args.report_parser.error("say what to write: --csv [FILE], --html [FILE], or both")
    course = _course(args)
    defaults = report_paths(course)
    if args.csv:
        target = defaults["csv"] if args.csv is True else Path(args.csv)
        csv_path, record_path = pipeline.write_report(course, target)
        print(f"wrote {csv_path} and {record_path}")
    if args.html:
        # Imported here: matplotlib is needed by this command only.
        from autograder import dashboard, records

        target = defaults["html"] if args.html is True else Path(args.html)
        print(f"wrote {dashboard.write_html(records.read_all(course.records), target)}")
    return 0


def cmd_demo(args) -> int:
    from autograder.submissions import demo_students

    started = time.monotonic()
    course = _checked(Course(Path(args.course) if args.course else ROOT / "build" / "demo" / "course", args.db_url))
    labs = [load_lab(name) for name in args.labs] if args.labs else list(all_labs().values())
    headers = _start_precompiled_headers(labs)
    build(course, [lab.name for lab in labs])
    # Labs that compile the student's source take longest: they start first, so that no worker is
    # left with one at the end while the others wait.
    labs.sort(key=lambda lab: -max(item.build_s for item in lab.items))
    jobs = [(lab.name, student) for lab in labs for student in demo_students(course, lab.name)]
    profile, seed = profiles.load(args.profile), _seed(args)
    built = time.monotonic()
    summary = _grade(course, jobs, args, profile=profile, seed=seed)
    if headers is not None:
        headers.join()
    graded = time.monotonic()
    failures = list(summary.failures)
    failures += _demo_feedback(course, labs, jobs)
    csv_path, record_path = pipeline.write_report(course, report_paths(course)["csv"])
    print(tables.grade_table(pipeline.report_rows(course)))
    print("\n".join(summary_lines(list(summary.graded.values()))))
    _print_failures(failures)
    names = " ".join(lab.name for lab in sorted(labs, key=lambda lab: lab.name))
    _print_seed(f"{_course_option(args)}demo {names}", seed, profile)
    print(f"\nreport: {csv_path}\nrecords: {record_path}\nfeedback: {course.root / 'feedback'}")
    ended = time.monotonic()
    print(f"demo took {ended - started:.0f} s: building the course {built - started:.0f} s, grading "
          f"{graded - built:.0f} s, feedback and report {ended - graded:.0f} s")
    return 0


def _start_precompiled_headers(labs: list) -> threading.Thread | None:
    """Where a lab builds C++, the builds' precompiled header (``fastdl_lab.custom.pch``, about 30 s
    on the 2-core machine) made while the course is built, which keeps one process busy, rather
    than by the first build's item, on a grading worker's clock. The first build waits on the
    header's lock until it is ready; where it cannot be made, that build says why."""
    if not any(item.build_s for lab in labs for item in lab.items):
        return None

    def make() -> None:
        from fastdl_lab.custom import pch, sources

        try:
            pch.ensure(sources.OPTIMISE)
        except Exception:  # noqa: BLE001 - the build that needs it reports the fault, named
            pass

    thread = threading.Thread(target=make, name="precompiled-headers", daemon=True)
    thread.start()
    return thread


def _demo_feedback(course: Course, labs: list, jobs: list[tuple[str, str]]) -> list[str]:
    """Every lab's feedback, two labs at a time: one lab's is one nbgrader process that keeps a
    core busy, and the labs' feedback folders and the gradebook rows they read are their own.
    Lines keep the batch's numbering (each lab's students after the labs listed before it)."""
    from concurrent.futures import ThreadPoolExecutor

    made, lock = Progress(len(jobs), desc="feedback"), threading.Lock()
    offsets, before = {}, 0
    for lab in labs:
        offsets[lab.name] = before
        before += sum(name == lab.name for name, _ in jobs)

    def one(lab) -> list[str]:
        def line(i, _, text):
            with lock:
                made.line(offsets[lab.name] + i, len(jobs), shown(text))

        return pipeline.feedback(course, lab, [s for name, s in jobs if name == lab.name], progress=line)

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
            return [failure for lab_failures in pool.map(one, labs) for failure in lab_failures]
    finally:
        made.close()


def check_text(record: dict, lab: str, profile: str, *, isolated: bool = True) -> str:
    """What a self-check prints. Checked without the sandbox, every line begins with ``UNSAFE``
    (the reasons' own UNSAFE prefix then goes: the line already says it)."""
    from autograder import selfcheck
    from autograder.engine.grade import UNISOLATED

    if isolated:
        head = [f"{lab} on the {profile} profile, graded by the course's grader (sandboxed, fresh hidden inputs)"]
        items, width = record["items"], tables.WIDTH
    else:
        head = [f"{lab} on the {profile} profile, checked WITHOUT the sandbox",
                "your code ran unconfined, as you: check only your own notebook this way"]
        items = [{**i, "reason": i["reason"].removeprefix(UNISOLATED)} for i in record["items"]]
        width = tables.WIDTH - len(UNSAFE_MARK)
    lines = [*head, f"notebook: {shown(record['notebook'])}", "a self-check is feedback, not a grade", "",
             tables.check_report({**record, "items": items}, selfcheck.HINTS, width=width),
             *_failure_lines(record.get("failures", []), width),
             f"\nkept in {selfcheck.progress_file(lab)}", f"all labs: {hints.progress()}"]
    text = "\n".join(lines)
    return text if isolated else "\n".join((UNSAFE_MARK + line).rstrip() for line in text.splitlines())


def cmd_check(args) -> int:
    from autograder import selfcheck

    lab = load_lab(args.lab)
    profile = profiles.load(args.profile)
    try:
        record = selfcheck.check(lab, Path(args.notebook) if args.notebook else None, course=_course(args),
                                 profile=profile, isolated=not args.unsafe_no_isolation)
    except selfcheck.CheckError as exc:
        print(f"cannot check: {exc}", file=sys.stderr)
        return 2
    print(check_text(record, lab.name, profile["name"], isolated=not args.unsafe_no_isolation))
    return 0


def cmd_progress(args) -> int:
    from autograder import selfcheck
    from autograder.course import lab_sources

    profile = profiles.load(args.profile)["name"]
    labs = {lab: selfcheck.item_progress(selfcheck.history(lab), profile) or None for lab in lab_sources()}
    print(tables.progress_view(labs, profile))
    return 0


def cmd_workspace(args) -> int:
    from autograder import selfstudy

    course = _course(args)
    made = selfstudy.prepare(course)
    work = selfstudy.work_dir()
    print(f"working folder {work}: {len(made)} new notebook(s), kernel '{selfstudy.KERNEL_NAME}' "
          f"(student package {course.student_package})")
    return 0


def cmd_roster_import(args) -> int:
    from autograder import roster

    course = _checked(_course(args))
    try:
        people = roster.read(Path(args.csv))
    except (OSError, UnicodeDecodeError, roster.RosterError) as exc:
        print(f"cannot read the roster: {exc}", file=sys.stderr)
        return 2
    course.root.mkdir(parents=True, exist_ok=True)  # a roster may come before the first build
    imported = roster.import_students(course.db_url, COURSE_ID, people)
    print(f"{len(people.students)} student(s) in the gradebook ({len(imported.new)} new, {len(imported.updated)} "
          f"updated), {len(people.instructors)} instructor(s) (gradebook: {gradebook.masked(course.db_url)})")
    if imported.not_on_roster:
        print(f"in the gradebook but not on this roster, left there with their grades: {', '.join(imported.not_on_roster)}")
    if args.hub:
        users = roster.write_hub_file(Path(args.hub), people)
        print(f"the hub's users and uids in {args.hub} ({len(users['students'])} student(s), "
              f"{len(users['instructors'])} instructor(s) may log in)")
    if people.refused:
        print(f"{len(people.refused)} row(s) of {args.csv} not imported (the others were):", file=sys.stderr)
        for problem in people.refused:
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 0


def cmd_roster_passwd(args) -> int:
    import json

    from autograder import roster

    print("\n".join(roster.passwd_lines(json.loads(Path(args.hub).read_text()))))
    return 0


def cmd_lab(args) -> int:
    """``make lab``: the workspace, then JupyterLab in its place (Ctrl+C reaches the server itself)."""
    from autograder import selfstudy

    cmd_workspace(args)
    work = selfstudy.work_dir()
    argv, env = selfstudy.lab_command(work, *args.jupyter_args)
    sys.stdout.flush()
    os.chdir(work)
    os.execve(argv[0], argv, env)


def parser() -> argparse.ArgumentParser:
    # Usage and errors name the interpreter by its path, as the commands the CLI prints do.
    p = argparse.ArgumentParser(prog=hints.autograder("").rstrip(), description=__doc__)
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
    grading.add_argument("--workers", type=int, help="submissions graded at once on this machine, each by a worker "
                         "process (default: one per core, or per GPU on a GPU profile)")
    grading.add_argument("--scheduler", metavar="ADDRESS", help="grade on the Dask cluster at ADDRESS (its workers "
                         "must see the course folder; on a GPU profile each declares --resources GPU=1)")
    grading.add_argument("--engine-only", action="store_true", help="grade with the trusted engine alone: nbgrader "
                         "does not run the notebooks (faster; formgrader then shows the submissions without outputs)")
    grading.add_argument("--unsafe-no-isolation", action="store_true",
                         help="grade where student code cannot be isolated (no bubblewrap or user namespaces); "
                              "every row of the report says so")

    s = sub.add_parser("autograde", parents=[grading], help="nbgrader autograde, then the trusted engine")
    s.add_argument("lab")
    s.add_argument("--student", action="append", help="grade only this student (repeatable)")
    s.add_argument("--cell-timeout", type=int, help="nbgrader per-cell timeout in seconds")
    s.add_argument("--item", action="append", help="grade only this item (repeatable), e.g. after fixing its "
                   "grading; the record keeps the other items' verdicts")
    s.add_argument("--resume", action="store_true", help="grade what the last, interrupted run of LAB left, with "
                   "its seed and profile")
    s.set_defaults(func=cmd_autograde, autograde_parser=s)

    s = sub.add_parser("feedback", help="HTML feedback with the trusted verdicts, no hidden tests")
    s.add_argument("lab")
    s.add_argument("--student", action="append")
    s.set_defaults(func=cmd_feedback)

    s = sub.add_parser("report", help="export grades (CSV) and/or an instructor's dashboard (HTML)")
    s.add_argument("--csv", metavar="FILE", nargs="?", const=True,
                   help="one row per student, lab and item: student, lab, item, score, max_score, counted, status, "
                        "reason; then a row per student and lab with the total of the counted rows (status total) "
                        "(records beside it; default FILE: report.csv beside the course folder, build/ by default)")
    s.add_argument("--html", metavar="FILE", nargs="?", const=True,
                   help="one offline page: score distributions, totals, common failure reasons, speed-ups per "
                        "hardware profile, grading time (default FILE: dashboard.html beside the course folder)")
    s.set_defaults(func=cmd_report, report_parser=s)

    s = sub.add_parser("check", help="self-study: grade your own notebook of LAB (default: work/LAB.ipynb) "
                                     "with the course's grader; kept for `progress`, never in the gradebook")
    s.add_argument("lab", help="a lab's number, topic or full name: 02, fusion, 02_fusion")
    s.add_argument("--notebook", metavar="PATH", help="the notebook to check (default: the working copy)")
    s.add_argument("--profile", choices=profiles.available(), help="hardware profile (default: this machine's)")
    s.add_argument("--unsafe-no-isolation", action="store_true", help="check without the sandbox, every line "
                   "printed marked UNSAFE: your own notebook only (make grade LAB=NN UNSAFE=1)")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("progress", help="self-study: which items pass in each lab, best speed-ups on this profile")
    s.add_argument("--profile", choices=profiles.available(), help="hardware profile (default: this machine's)")
    s.set_defaults(func=cmd_progress)

    s = sub.add_parser("workspace", help="student mode: fresh release, working copies in work/, the student kernel")
    s.set_defaults(func=cmd_workspace)

    s = sub.add_parser("roster", help="the class roster (CSV) into the gradebook and the hub's users")
    roster_sub = s.add_subparsers(dest="roster_command", required=True)
    r = roster_sub.add_parser("import", help="students (with names) into the gradebook from CSV, columns id, "
                              "first_name, last_name, email, lms_user_id, role (student or instructor); bad rows "
                              "are named and skipped, the rest imported")
    r.add_argument("csv", help="the roster, with a header row (nbgrader db student import's format, and role)")
    r.add_argument("--hub", metavar="FILE", help="also write who may log in to the hub, their groups and uids "
                   "(JSON, read by deploy/production/jupyterhub_config.py); uids already in FILE are kept")
    r.set_defaults(func=cmd_roster_import)
    r = roster_sub.add_parser("passwd", help="/etc/passwd lines for the uids of a hub file, for the grading side")
    r.add_argument("hub", metavar="FILE", help="the file roster import --hub wrote")
    r.set_defaults(func=cmd_roster_passwd)

    s = sub.add_parser("lab", help="student mode: the workspace, then JupyterLab on it with the self-study settings "
                                   "(make lab); any further arguments go to JupyterLab, e.g. --no-browser --port 8890")
    s.set_defaults(func=cmd_lab)

    s = sub.add_parser("demo", parents=[grading], help="build, grade the bundled demo submissions, report")
    s.add_argument("labs", nargs="*")
    s.set_defaults(func=cmd_demo)
    return p


def _unsafe_hint(args, argv: list[str]) -> str:
    """The command that runs this one again without the sandbox. A learner's plain check of a lab
    is sent to ``make grade LAB=NN UNSAFE=1``; anything else is this command line with the flag."""
    if args.command == "check" and not (args.notebook or args.profile or args.course or args.db_url):
        return hints.check(args.lab, unsafe=True)
    # A gradebook's password typed on the command line is not printed back (the URL shows ***).
    shown_argv = [gradebook.masked(word) if args.db_url and word in (args.db_url, f"--db-url={args.db_url}")
                  else word for word in argv]
    return hints.autograder(shlex.join([*shown_argv, "--unsafe-no-isolation"]))


def main(argv: list[str] | None = None) -> int:
    from autograder.engine.bwrap import IsolationUnavailable
    from autograder.engine.toolchain import ToolMissing

    argv = sys.argv[1:] if argv is None else list(argv)
    # `lab` hands the arguments it does not know to JupyterLab (argparse's REMAINDER would take
    # none that start with a dash); every other command refuses them.
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and args.command != "lab":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.jupyter_args = extra
    # nbgrader and its tools are run by name (alembic): this interpreter's bin first, whether or
    # not the venv was activated.
    os.environ["PATH"] = tool_env()["PATH"]
    try:
        return args.func(args)
    except gradebook.GradebookUnavailable as exc:
        print(f"stopped before any work: {exc}", file=sys.stderr)
        return 2
    except gradebook.MaximumMismatch as exc:
        print(f"stopped: {exc.text(_course_options(args))}", file=sys.stderr)
        return 2
    except IsolationUnavailable as exc:
        install = "Install bubblewrap (sudo apt-get install bubblewrap; the Makefile does it where it runs as root)"
        if args.command == "check":
            print(f"cannot check: your code cannot be isolated on this machine: {exc}.\n{install},\nor check "
                  f"your own notebook without the sandbox, every line of the result marked UNSAFE:\n"
                  f"  {_unsafe_hint(args, argv)}", file=sys.stderr)
        else:
            print(f"cannot grade: student code cannot be isolated on this machine: {exc}.\n{install},\nor grade "
                  f"code you trust without the sandbox, every row marked unsafe:\n  {_unsafe_hint(args, argv)}",
                  file=sys.stderr)
        return 2
    except device.InterpreterBroken as exc:
        print(f"cannot grade on a CPU profile: {exc}", file=sys.stderr)
        return 2
    except ToolMissing as exc:
        print(f"cannot grade on a GPU profile: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Every submission written so far is in the run journal (autograder/journal.py).
        rest = ""
        if args.command == "autograde":
            again = hints.autograder(f"{_course_option(args)}autograde {shlex.quote(args.lab)} --resume")
            rest = f"; {again} grades the rest"
        print(f"\ninterrupted: what was graded is kept{rest}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
