"""nbgrader's gradebook: which database, whether it answers, copying it, and the engine's scores.

The gradebook is any database SQLAlchemy opens: a SQLite file in the course folder by default, or
a PostgreSQL database (``FASTDL_GRADEBOOK_URL`` or ``--db-url``) for many writers at once. A URL
may hold a password, so every URL shown to people goes through ``masked``.

Each item's score goes into both ``auto_score`` and ``manual_score`` of its test cell (nbgrader
ranks the manual one first), so formgrader, feedback and grade exports all show the engine's
figure and no figure of nbgrader's own run of the notebook survives beside it. An item the profile
does not grade (a speed item without a GPU) is worth nothing in the gradebook: its test cell's
maximum is set to 0, so the gradebook's total is the engine's (6/13, not 6/15), and its comment
says the points were left out. The reasons become comments on the item's solution cells.

nbgrader's ``generate_assignment`` (run by every ``build``) writes each test cell's points from the
notebook back into the gradebook, so ``build`` restores the maxima the lab's grading records give
(``restore_maxima``), and ``feedback`` refuses to render a total those records do not give
(``check_maxima``).
"""

from __future__ import annotations

import html
import re
import shlex
import warnings
from urllib.parse import unquote

from nbgrader.api import Base, Gradebook, MissingEntry
from nbformat import NotebookNode
from nbgrader.utils import compute_checksum, parse_utc
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SAWarning, SQLAlchemyError

from autograder.engine.items import LabSpec
from autograder.records import clean_reason

URL_VAR = "FASTDL_GRADEBOOK_URL"
# A server that drops packets would otherwise hold the instructor's command for minutes.
CONNECT_TIMEOUT_S = 10
# For text that is not a URL at all: whatever sits between "user:" and "@" is taken for a password.
_LOOSE_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


class GradebookUnavailable(RuntimeError):
    """The gradebook cannot be opened; the message names the reason, never the password."""


class MaximumMismatch(RuntimeError):
    """The gradebook counts a lab out of another maximum than its grading records do: nbgrader's
    feedback and export would show a total that the CLI, the CSV and the dashboard do not."""

    def __init__(self, message: str, command: list[str]):
        super().__init__(message)
        self.command = command  # the autograder command that puts it right, without `python -m autograder`

    def text(self, options: list[str] | tuple[str, ...] = ()) -> str:
        """The reason and the command that fixes it, with the CLI's own ``options`` (``--course DIR``)."""
        from autograder.hints import autograder  # here: hints imports the course, which imports this module

        return f"{self.args[0]}: {autograder(shlex.join([*options, *self.command]))}"

    def __str__(self) -> str:
        return self.text()


def _parse(url: str) -> URL | None:
    try:
        return make_url(url)
    except ArgumentError:
        return None


def with_driver(url: str) -> str:
    """``url`` with the PostgreSQL driver named: SQLAlchemy 2.1 reads a bare ``postgresql://`` as
    psycopg 3, 2.0 as psycopg2, and psycopg2 is the driver this project installs."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg2://{rest}" if sep and scheme == "postgresql" else url


def has_password(url: str) -> bool:
    parsed = _parse(url)
    return parsed is None or bool(parsed.password or parsed.query.get("password"))


def masked(url: str) -> str:
    """``url`` as it may be printed: a password, in the address or as a ``password=`` query
    parameter (libpq reads both), is shown as ``***``."""
    parsed = _parse(url)
    if parsed is None:
        return _LOOSE_PASSWORD.sub(r"\1***@", url)
    query = {key: "***" if key == "password" else value for key, value in parsed.query.items()}
    # Rendering percent-encodes the query (a socket folder's slashes); people read it decoded.
    return unquote(parsed.set(query=query).render_as_string(hide_password=True))


def _scrubbed(message: str, parsed: URL) -> str:
    """A driver's message on one line, with the URL's secrets taken out should it quote them."""
    for secret in (parsed.password, parsed.query.get("password")):
        if isinstance(secret, str) and secret:
            message = message.replace(secret, "***")
    return " ".join(message.split())


def check(url: str) -> None:
    """Raise ``GradebookUnavailable`` unless a connection to the gradebook at ``url`` opens."""
    parsed = _parse(url)
    if parsed is None:
        raise GradebookUnavailable(f"not a database URL: {masked(url)}")
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return  # nothing to reach: nbgrader makes the file where the course says
    connect_args = {"connect_timeout": CONNECT_TIMEOUT_S} if backend == "postgresql" else {}
    try:
        engine = sa.create_engine(parsed, connect_args=connect_args)
    except (ImportError, NoSuchModuleError) as exc:
        from autograder.hints import python  # here: hints imports the course, which imports this module

        hint = f" ({python()} -m pip install psycopg2-binary)" if getattr(exc, "name", None) == "psycopg2" else ""
        raise GradebookUnavailable(
            f"cannot open the gradebook at {masked(url)}: its database driver is missing{hint}: {exc}") from None
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except SQLAlchemyError as exc:
        reason = _scrubbed(str(getattr(exc, "orig", None) or exc), parsed)
        # Not chained: the reason is the driver's whole message, already scrubbed.
        raise GradebookUnavailable(f"cannot reach the gradebook at {masked(url)}: {reason}") from None
    finally:
        engine.dispose()


def copy(source_url: str, target_url: str) -> None:
    """Every row of the gradebook at ``source_url`` into an empty database at ``target_url``,
    which may be of another kind (a PostgreSQL gradebook into a SQLite file)."""
    source, target = sa.create_engine(source_url), sa.create_engine(target_url)
    try:
        if not sa.inspect(source).has_table("assignment"):
            raise GradebookUnavailable(f"no gradebook at {masked(source_url)}: build the course first")
        Base.metadata.create_all(target)
        with source.connect() as src, target.begin() as dst:
            for table in Base.metadata.sorted_tables:  # parents before the rows that point at them
                rows = [dict(row) for row in src.execute(sa.select(table)).mappings()]
                if rows:
                    dst.execute(sa.insert(table), rows)
            # nbgrader's own schema version, which `nbgrader db upgrade` reads; not one of its models.
            if sa.inspect(src).has_table("alembic_version"):
                versions = src.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
                dst.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
                for version in versions:
                    dst.execute(sa.text("INSERT INTO alembic_version (version_num) VALUES (:v)"), {"v": version})
    finally:
        source.dispose()
        target.dispose()


# nbgrader's feedback renders comments as Markdown, raw HTML and links included: a reason that
# quotes student output must come out as text. HTML is escaped; backslashes and brackets are
# escaped so that no link or image can be formed.
_MARKDOWN_SPECIAL = re.compile(r"([\\\[\]])")


def comment_line(item: str, status: str, reason: object) -> str:
    text = html.escape(f"{item}: {status} - {clean_reason(reason)}", quote=False)
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def write_scores(db_url: str, lab: LabSpec, student: str, results: list[dict], *,
                 auto_grades: dict | None = None, auto_comments: dict | None = None,
                 timestamp: str | None = None) -> list[str]:
    """The engine's ``results`` as the scores of ``student``'s submission of ``lab``; ``auto_grades``
    and ``auto_comments`` (cell name -> value) are what nbgrader's own run found, kept beside them
    for cells that are no engine item. ``timestamp`` is the submission's time from nbgrader's
    exchange: formgrader shows a submission whose time differs from its gradebook entry as not
    graded yet, with no score. Returns warnings for the instructor (not grades)."""
    items = {item.name for item in lab.items}
    warnings_out: list[str] = []
    with Gradebook(db_url) as gb:
        gb.update_or_create_student(student)
        try:
            gb.find_submission(lab.name, student)
        except MissingEntry:
            # nbgrader's run writes a scratch gradebook (autograder/jobs.py), never this one: the
            # submission is created here, also when nbgrader could not execute the notebook.
            with warnings.catch_warnings():
                # nbgrader's add_submission trips SQLAlchemy's autoflush warnings on every call; harmless.
                warnings.simplefilter("ignore", category=SAWarning)
                gb.add_submission(lab.name, student)
        if timestamp is not None:
            gb.find_submission(lab.name, student).timestamp = parse_utc(timestamp)
        for cell, score in (auto_grades or {}).items():
            if cell in items:
                continue  # the engine's verdict is this cell's score, whatever the notebook's run showed
            try:
                gb.find_grade(cell, lab.name, lab.name, student).auto_score = score
            except MissingEntry:
                continue
        comments: dict[str, list[str]] = {}
        for result in results:
            item = lab.item(result["item"])
            grade = gb.find_grade(item.name, lab.name, lab.name, student)
            score = result["score"] if result["counted"] else 0.0
            grade.auto_score = grade.manual_score = score
            grade.needs_manual_grade = False
            stranded = _set_counted(gb, lab.name, item.name, item.points if result["counted"] else 0.0)
            if stranded:
                warnings_out.append(f"{lab.name} {student}: {stranded}")
            for cell in item.cells:
                comments.setdefault(cell, []).append(comment_line(item.name, result["status"], result["reason"]))
        for cell, lines in comments.items():
            try:
                comment = gb.find_comment(cell, lab.name, lab.name, student)
            except MissingEntry:
                continue
            comment.auto_comment = "\n".join(filter(None, [(auto_comments or {}).get(cell), *lines]))
        gb.db.commit()
    return warnings_out


def grade_cell_checksum(gb: Gradebook, lab: str, name: str, points: float) -> str:
    """nbgrader's checksum of grade cell ``name`` of ``lab`` as the gradebook holds it, worth ``points``."""
    source = gb.find_source_cell(name, lab, lab)
    try:
        gb.find_solution_cell(name, lab, lab)
        solution = True
    except MissingEntry:
        solution = False
    cell = NotebookNode(cell_type=source.cell_type, source=source.source, metadata=NotebookNode(nbgrader=NotebookNode(
        grade=True, solution=solution, locked=source.locked, grade_id=name, points=points)))
    return compute_checksum(cell)


def _set_counted(gb: Gradebook, lab: str, item: str, points: float) -> str:
    """Make ``item``'s test cell worth ``points`` in ``lab``: its full points where the profile grades
    it, 0 where it is left out. The maximum belongs to the assignment, not to one submission, so a
    lab graded on two kinds of hardware cannot show both: say so when the change strands a score."""
    cell = gb.find_grade_cell(item, lab, lab)
    if cell.max_score == points:
        return ""
    cell.max_score = points
    # nbgrader's OverwriteCells checks each locked cell against its checksum, which counts its points:
    # the stored checksum follows the new maximum, or every later nbgrader autograde of the lab fails.
    source = gb.find_source_cell(item, lab, lab)
    source.checksum = grade_cell_checksum(gb, lab, item, points)
    over = sorted(g.student.id for g in cell.grades if (g.score or 0.0) > points)
    if not over:
        return ""
    return (f"'{item}' is now worth {points:g} points (this profile), but {len(over)} submission(s) graded "
            f"on another profile hold more ({', '.join(over[:3])}): regrade the lab on one profile")


def _worth(verdict: dict) -> float:
    """What one recorded verdict makes its item worth in the gradebook (``write_scores``)."""
    return float(verdict["max_score"]) if verdict.get("counted", True) else 0.0


def _verdicts(lab: LabSpec, lab_records: list[dict]):
    """(record, verdict) for every verdict of ``lab``'s records that was written to the gradebook: a
    job the grader lost (``not_graded``) wrote nothing there, and an item no longer in the lab has no cell."""
    names = {item.name for item in lab.items}
    for record in lab_records:
        for verdict in record["items"]:
            if verdict["item"] in names and verdict["status"] != "not_graded":
                yield record, verdict


def recorded_maxima(lab: LabSpec, lab_records: list[dict]) -> dict[str, float]:
    """Each item's maximum as the latest grading of it left the gradebook: its points, or 0 where
    that grading's profile left it out. Items no record grades are not in the answer."""
    latest = sorted(_verdicts(lab, lab_records), key=lambda pair: pair[0].get("graded_at", ""))
    return {verdict["item"]: _worth(verdict) for _, verdict in latest}


def restore_maxima(db_url: str, lab: LabSpec, lab_records: list[dict]) -> list[str]:
    """Give each graded item of ``lab`` back the maximum its latest grading set, after nbgrader's
    ``generate_assignment`` set every test cell to its notebook's points (the GPU points of a lab
    graded on the CPU counted again). Returns what the instructor should read."""
    wanted = recorded_maxima(lab, lab_records)
    if not wanted:
        return []
    notes = []
    with Gradebook(db_url) as gb:
        for name, points in wanted.items():
            try:
                stranded = _set_counted(gb, lab.name, name, points)
            except MissingEntry:
                continue  # the rebuilt notebook has no test cell for it: nothing to keep
            if stranded:
                notes.append(f"{lab.name}: {stranded}")
        gb.db.commit()
    left_out = [name for name, points in wanted.items() if points == 0]
    if left_out:
        notes.insert(0, f"{lab.name} has grades: the gradebook keeps {', '.join(left_out)} out of its total "
                        "(0 points), as its latest grading left it")
    return notes


def check_maxima(db_url: str, lab: LabSpec, lab_records: list[dict], students: list[str] | None = None) -> None:
    """Raise ``MaximumMismatch`` where the gradebook's maximum of an item of ``lab`` is not what the
    records of ``students`` (default: every record) make it. The message names the lab, both
    totals, the items that differ, and the command that fixes it: ``build LAB`` restores the records'
    maxima; where the records disagree among themselves (a lab graded on two profiles), only a
    regrade on one profile can."""
    graded = [record for record in lab_records if students is None or record["student"] in students]
    if not graded:
        return
    with Gradebook(db_url) as gb:
        try:
            total = float(gb.find_assignment(lab.name).max_score)
        except MissingEntry:
            return  # not built: nbgrader's own command says so
        held = {}
        for item in lab.items:
            try:
                held[item.name] = float(gb.find_grade_cell(item.name, lab.name, lab.name).max_score)
            except MissingEntry:
                continue
    off: dict[str, dict[str, float]] = {}
    for record, verdict in _verdicts(lab, graded):
        if verdict["item"] in held and _worth(verdict) != held[verdict["item"]]:
            off.setdefault(record["student"], {})[verdict["item"]] = _worth(verdict)
    if not off:
        return
    student = sorted(off)[0]
    theirs = total + sum(points - held[name] for name, points in off[student].items())
    items = "; ".join(f"{name}: {held[name]:g} in the gradebook, {points:g} in the records"
                      for name, points in sorted(off[student].items()))
    who = f"{student}'s record" if len(off) == 1 else f"the records of {len(off)} students, e.g. {student}'s"
    message = (f"the gradebook counts {lab.name} out of {total:g} points, {who} out of {theirs:g} ({items}): "
               f"nbgrader's feedback and export would show {total:g}, the CLI, the CSV and the dashboard {theirs:g}")
    worths: dict[str, set[float]] = {}
    for _, verdict in _verdicts(lab, lab_records):
        worths.setdefault(verdict["item"], set()).add(_worth(verdict))
    split = sorted(name for name, seen in worths.items() if len(seen) > 1)
    if split:
        profiles = sorted({record.get("profile", "?") for record in lab_records})
        latest = max(lab_records, key=lambda record: record.get("graded_at", "")).get("profile", "?")
        raise MaximumMismatch(f"{message}. The records themselves disagree on {', '.join(split)} (graded on the "
                              f"{' and '.join(profiles)} profiles): regrade the lab on one profile",
                              ["autograde", lab.name, "--profile", latest])
    raise MaximumMismatch(f"{message}. nbgrader's generate_assignment (formgrader's Generate, nbgrader's own "
                          "command, an older build) set the gradebook back to the notebook's points; restore the "
                          "records' maxima (nothing is regraded)", ["build", lab.name])
