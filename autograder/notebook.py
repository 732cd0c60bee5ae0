"""Reading a submitted notebook without executing it: graded cells by grade_id, and tampering.

A submission is compared with the release the student was given: a test cell that is missing,
duplicated or whose source differs from the release costs its item, with the reason named.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autograder.engine.items import Item

UNANSWERED = "raise NotImplementedError()"
# Far above any lab notebook with its outputs; anything larger is refused before it is parsed.
MAX_NOTEBOOK_BYTES = 20 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused right after, by fstat.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFREG: "a file",
          stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}


class NotebookError(Exception):
    """The file is not a notebook the grader can read; the message says why."""


@dataclass
class GradedCells:
    solutions: dict[str, str]  # grade_id -> source
    tests: dict[str, str]
    duplicates: frozenset[str] = field(default_factory=frozenset)  # grade_ids on more than one cell


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(map(str, src)) if isinstance(src, list) else str(src)


def graded_cells(nb: dict) -> GradedCells:
    solutions, tests, seen, duplicates = {}, {}, set(), set()
    for cell in nb.get("cells", []):
        meta = cell.get("metadata") if isinstance(cell, dict) else None
        meta = meta.get("nbgrader") if isinstance(meta, dict) else None
        grade_id = meta.get("grade_id") if isinstance(meta, dict) else None
        if not isinstance(grade_id, str):
            continue
        # Two cells under one id make it ambiguous which one nbgrader ran and which one is graded.
        (duplicates if grade_id in seen else seen).add(grade_id)
        if cell.get("cell_type") != "code":
            continue
        if meta.get("solution"):
            solutions[grade_id] = _source(cell)
        elif meta.get("grade"):
            tests[grade_id] = _source(cell)
    return GradedCells(solutions, tests, frozenset(duplicates))


def _refused(name: str, mode: int, expected: str) -> NotebookError:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return NotebookError(f"refused: '{name}' is {kind}, not {expected}; submissions are never read through links "
                         "or special files")


def _open_error(dir_fd: int, name: str, exc: OSError, last: bool) -> NotebookError:
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except OSError:
        mode = None
    if mode is None or (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
        return NotebookError(f"notebook cannot be read: {exc.strerror}: '{name}'")
    return _refused(name, mode, "a file" if last else "a folder")


def _read_regular_file(path: Path) -> bytes:
    """The bytes of ``path``, opened one component at a time without following any link.

    A student who controls part of the submission tree could link their folder to another
    student's, or leave a FIFO or a device where the notebook should be: every component must be
    a real folder and the last a regular file of at most MAX_NOTEBOOK_BYTES. Only the course root
    may hold links, and ``Course`` resolves it before any path is built from it.
    """
    parts = Path(os.path.abspath(path)).parts
    fd = os.open(parts[0], _DIR_FLAGS)
    try:
        for depth, name in enumerate(parts[1:], 2):
            last = depth == len(parts)
            try:
                child = os.open(name, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _open_error(fd, name, exc, last) from exc
            os.close(fd)
            fd = child
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(parts[-1], info.st_mode, "a file")
        # The size from fstat can change under us: read one byte past the cap, never more.
        chunks, size = [], 0
        while size <= MAX_NOTEBOOK_BYTES and (chunk := os.read(fd, min(1 << 20, MAX_NOTEBOOK_BYTES + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_NOTEBOOK_BYTES:
            raise NotebookError(f"refused: the notebook is larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_notebook(path: Path) -> dict:
    try:
        text = _read_regular_file(Path(path)).decode("utf-8")
    except OSError as exc:
        raise NotebookError(f"notebook cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise NotebookError(f"notebook cannot be read: not UTF-8 text (byte {exc.start})") from exc
    try:
        nb = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookError(f"notebook is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    except RecursionError as exc:
        raise NotebookError("notebook is not valid JSON (nested too deeply)") from exc
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotebookError("notebook has no list of cells (not an .ipynb file?)")
    return nb


# What nbgrader's exchange writes beside a submitted notebook, and how long each can be.
EXCHANGE_NOTES = {"timestamp.txt": 64, "submission_secret.txt": 256}


def read_exchange_note(folder: Path, name: str) -> str | None:
    """A file nbgrader's exchange wrote beside a submitted notebook (``EXCHANGE_NOTES``), or None
    when there is none. nbgrader files released feedback under the submission's time and secret,
    so they must be read, yet they sit in the student's folder: read like a notebook (no links, no
    special files), short, printable, and the time must parse as one."""
    from nbgrader.utils import parse_utc

    path = Path(folder) / name
    if not os.path.lexists(path):
        return None
    try:
        text = _read_regular_file(path).decode("ascii").strip()
    except OSError as exc:
        raise NotebookError(f"{name} cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{name} is not ASCII text") from exc
    if len(text) > EXCHANGE_NOTES[name] or not text.isprintable():
        raise NotebookError(f"{name} is not what nbgrader writes there (longer than {EXCHANGE_NOTES[name]} "
                            "characters or not printable)")
    if name == "timestamp.txt":
        try:
            parse_utc(text)
        except (ValueError, OverflowError) as exc:
            raise NotebookError(f"{name} does not hold a time ({exc})") from exc
    return text


def copy_exchange_notes(submitted: Path, autograded: Path) -> str | None:
    """Put the exchange's notes of the submission in folder ``submitted`` beside its autograded
    notebook, as nbgrader's autograde does; returns the submission's time, if it has one.
    formgrader counts a submission as graded only when the gradebook holds that same time, and
    nbgrader releases feedback under it and the secret."""
    notes = {name: read_exchange_note(submitted, name) for name in EXCHANGE_NOTES}
    for name, text in notes.items():
        if text is not None:
            Path(autograded).mkdir(parents=True, exist_ok=True)
            (Path(autograded) / name).write_text(text)
    return notes["timestamp.txt"]


def _normalise(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def test_cell_problem(test_id: str, submitted: GradedCells, released: GradedCells,
                      solution_ids: tuple[str, ...] = ()) -> str | None:
    """Why the item counts as tampered with (its test cell, or one of ``solution_ids``), or None."""
    if test_id not in submitted.tests:
        return f"test cell '{test_id}' was deleted"
    duplicated = [c for c in (test_id, *solution_ids) if c in submitted.duplicates]
    if duplicated:
        return f"cell id '{duplicated[0]}' appears on more than one cell (duplicated grade_id)"
    if _normalise(submitted.tests[test_id]) != _normalise(released.tests.get(test_id, "")):
        return f"test cell '{test_id}' was edited (test cells are locked)"
    return None


def solution_problem(cell_ids: tuple[str, ...], submitted: GradedCells, released: GradedCells) -> str | None:
    """Why the item cannot be graded from its solution cells, or None."""
    duplicated = [c for c in cell_ids if c in submitted.duplicates]
    if duplicated:
        return f"solution cell '{duplicated[0]}' appears on more than one cell (duplicated grade_id)"
    missing = [c for c in cell_ids if c not in submitted.solutions]
    if missing:
        return f"solution cell '{missing[0]}' is missing"
    untouched = [
        c for c in cell_ids
        if UNANSWERED in submitted.solutions[c] and _normalise(submitted.solutions[c]) == _normalise(released.solutions.get(c, ""))
    ]
    if untouched:
        return f"not attempted: solution cell '{untouched[0]}' is as released"
    return None


def needs_gpu(item: Item, profile: dict) -> bool:
    """A speed item on a profile without a GPU is left out of the total, whatever the notebook holds."""
    # speed_on_cpu exists to exercise the timing protocol in tests; no real profile sets it.
    return item.is_speed and not (profile.get("gpu") or profile.get("speed_on_cpu"))


# nbgrader keeps every byte a kernel printed in the executed notebook, and feedback renders it all.
MAX_OUTPUT_CHARS = 20_000
TRUNCATED = "\n[... output cut by the grader: {} more characters]\n"


def _cap(text, limit: int) -> str:
    text = "".join(text) if isinstance(text, list) else str(text)
    # The slack keeps a cut text (limit plus the marker) from being cut again.
    return text if len(text) <= limit + 100 else text[:limit] + TRUNCATED.format(len(text) - limit)


def cap_outputs(path: Path, limit: int = MAX_OUTPUT_CHARS) -> bool:
    """Cut every stream, error and text output of the executed notebook at ``path`` to ``limit``
    characters; True when something was cut. A missing or unreadable file is left alone."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    cut = False
    for cell in nb.get("cells", []) if isinstance(nb, dict) else []:
        for output in cell.get("outputs", []) if isinstance(cell, dict) else []:
            if not isinstance(output, dict):
                continue
            fields = [("text", output)] if "text" in output else []
            fields += [(key, output["data"]) for key in ("text/plain", "text/html")
                       if isinstance(output.get("data"), dict) and key in output["data"]]
            if output.get("output_type") == "error" and isinstance(output.get("traceback"), list):
                lines = [_cap(line, limit) for line in output["traceback"][:50]]
                cut |= lines != output["traceback"]
                output["traceback"] = lines
            for key, holder in fields:
                capped = _cap(holder[key], limit)
                cut |= capped != ("".join(holder[key]) if isinstance(holder[key], list) else holder[key])
                holder[key] = capped
    if cut:
        Path(path).write_text(json.dumps(nb), encoding="utf-8")
    return cut
