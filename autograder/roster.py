"""A class roster from a CSV file: the gradebook's students, with their names, and the hub's users.

The CSV is the one ``nbgrader db student import`` reads (a header row; columns ``id``, ``first_name``,
``last_name``, ``email``, ``lms_user_id``), with one optional column more, ``role`` (``student``, the
default, or ``instructor``). Each row is checked on its own: a row that cannot be a hub user or a
gradebook student is refused with the reason and its line number, and every other row is imported.

The hub's file (``--hub FILE``, JSON) lists who may log in, in which group, and the Unix uid each
user's server runs as. A uid, once given, stays with its name for good (a later import keeps it,
and a name dropped from the roster keeps its uid out of use), so the files a student left in the
exchange or a home volume never pass to someone else. The grading side maps the same uids back to
names (``passwd_lines``), which is how nbgrader's collect tells an honest submission from one
filed under another student's name.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from pathlib import Path

COLUMNS = ("id", "first_name", "last_name", "email", "lms_user_id", "role")
ROLES = ("student", "instructor")
# Debian gives system accounts uids below 1000 and people uids from 1000 up: a course's users, from
# 20000 up, never share a uid with an account of the image.
FIRST_UID = 20000
# The gid every course user's server runs with; the grading side's files are readable through it.
COURSE_GID = 100
# nbgrader's gradebook columns hold 128 characters.
MAX_FIELD = 128
# What a JupyterHub user name and an nbgrader student id can both be: JupyterHub lower-cases the
# names it logs in, nbgrader splits exchange file names on "+", and the name becomes a folder, a
# container's and a volume's name. An e-mail address (OAuth's usual name) fits.
NAME = re.compile(r"[a-z0-9][a-z0-9._@-]{0,63}")


class RosterError(ValueError):
    """The roster file as a whole cannot be read (no header, no id column, not a CSV)."""


@dataclasses.dataclass(frozen=True)
class Person:
    id: str
    role: str = "student"
    first_name: str | None = None
    last_name: str | None = None
    email: str | None = None
    lms_user_id: str | None = None

    def gradebook_fields(self) -> dict[str, str]:
        """The fields this row gives; an empty cell or a missing column leaves the gradebook's value."""
        fields = {"first_name": self.first_name, "last_name": self.last_name, "email": self.email,
                  "lms_user_id": self.lms_user_id}
        return {k: v for k, v in fields.items() if v}


@dataclasses.dataclass
class Roster:
    people: list[Person]
    refused: list[str]  # "line N: reason", one per refused row

    @property
    def students(self) -> list[Person]:
        return [p for p in self.people if p.role == "student"]

    @property
    def instructors(self) -> list[Person]:
        return [p for p in self.people if p.role == "instructor"]


def _problem(row: dict[str, str], seen: dict[str, int]) -> str | None:
    """Why ``row`` cannot be imported, or None."""
    name = row.get("id", "")
    if not name:
        return "no id"
    if name != name.lower() and NAME.fullmatch(name.lower()):
        return (f"id {name!r} has upper-case letters; JupyterHub lower-cases every name it logs in, so the "
                f"gradebook would never match the hub: write {name.lower()!r}")
    if not NAME.fullmatch(name):
        return (f"id {name!r} is not a name the hub and nbgrader both accept (1-64 of a-z 0-9 . _ @ -, starting "
                "with a letter or digit; nbgrader's exchange splits file names on '+')")
    if name in seen:
        return f"id {name!r} is already on line {seen[name]}"
    role = row.get("role") or "student"
    if role not in ROLES:
        return f"role {role!r} is neither 'student' nor 'instructor'"
    for field in COLUMNS[1:5]:
        if len(row.get(field) or "") > MAX_FIELD:
            return f"{field} is longer than the gradebook's {MAX_FIELD} characters"
    return None


def read(path: Path) -> Roster:
    """Every row of the CSV at ``path`` that can be imported, and a reason for each that cannot."""
    with open(path, newline="", encoding="utf-8-sig") as fh:  # a spreadsheet's export may start with a BOM
        reader = csv.DictReader(fh)
        if not reader.fieldnames:
            raise RosterError(f"{path} is empty: it needs a header row naming its columns ({', '.join(COLUMNS)})")
        header = [(f or "").strip().lower() for f in reader.fieldnames]
        if "id" not in header:
            raise RosterError(f"{path}'s header has no 'id' column (it has: {', '.join(header)})")
        unknown = sorted(set(header) - set(COLUMNS) - {""})
        if unknown:
            raise RosterError(f"{path}'s header has columns nbgrader's gradebook does not hold: {', '.join(unknown)} "
                              f"(known: {', '.join(COLUMNS)})")
        reader.fieldnames = header
        people, refused, seen = [], [], {}
        for row in reader:
            line = reader.line_num
            if None in row:
                refused.append(f"line {line}: {len(header) + len(row[None])} fields where the header has {len(header)}")
                continue
            row = {k: (v or "").strip() for k, v in row.items() if k}
            if not any(row.values()):
                continue  # a blank line at the end of a spreadsheet's export
            problem = _problem(row, seen)
            if problem:
                refused.append(f"line {line}: {problem}")
                continue
            seen[row["id"]] = line
            people.append(Person(row["id"], row.get("role") or "student",
                                 **{f: row.get(f) or None for f in COLUMNS[1:5]}))
    return Roster(people, refused)


@dataclasses.dataclass(frozen=True)
class Imported:
    new: list[str]
    updated: list[str]
    not_on_roster: list[str]  # in the gradebook, not in this roster: left there (they may have grades)


def import_students(db_url: str, course_id: str, roster: Roster) -> Imported:
    """The roster's students into the gradebook at ``db_url``, names and all; nobody is removed."""
    from nbgrader.api import Gradebook

    new, updated = [], []
    with Gradebook(db_url, course_id) as gb:
        existing = {s.id for s in gb.students}
        for person in roster.students:
            gb.update_or_create_student(person.id, **person.gradebook_fields())
            (updated if person.id in existing else new).append(person.id)
        listed = {p.id for p in roster.students}
        return Imported(new, updated, sorted(existing - listed))


def hub_users(roster: Roster, previous: dict | None = None) -> dict:
    """The hub's view of ``roster``: who may log in, the two groups, and each name's uid (kept from
    ``previous``, the file an earlier import wrote; new names get the next uid never used)."""
    uids = dict((previous or {}).get("uids", {}))
    next_uid = max([FIRST_UID - 1, *uids.values()]) + 1
    for person in roster.people:
        if person.id not in uids:
            uids[person.id] = next_uid
            next_uid += 1
    return {
        "instructors": [p.id for p in roster.instructors],
        "students": [p.id for p in roster.students],
        "uids": uids,
        "gid": COURSE_GID,
    }


def write_hub_file(path: Path, roster: Roster) -> dict:
    previous = json.loads(path.read_text()) if path.is_file() else None
    users = hub_users(roster, previous)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(users, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # the hub may read it at any moment: never half written
    return users


def passwd_lines(users: dict) -> list[str]:
    """/etc/passwd lines naming every uid of the hub's file, for the grading side, whose nbgrader
    compares a submission's owner with the name it was filed under. No login, no home."""
    return [f"{name}:x:{uid}:{users.get('gid', COURSE_GID)}::/nonexistent:/usr/sbin/nologin"
            for name, uid in sorted(users["uids"].items(), key=lambda item: item[1])]
