"""Self-grading: the learner's own notebook through the course's grader, and progress across labs.

``check`` grades a working notebook exactly as a class is graded (``batch.grade``: the trusted
engine, every item in the sandbox, inputs from a fresh secret seed), in a throw-away copy of the
course build with a gradebook of its own: nothing of the instructor's course (gradebook, records,
submissions) is written. The learner keeps one line per check in ``work/.progress/<lab>.jsonl``,
from which ``progress`` shows which items pass and the best speed-up measured on each profile.
A self-check is feedback, not a grade.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from autograder import batch, hints, notebook, profiles
from autograder.course import Course, copy_build, lab_sources
from autograder.engine.items import LabSpec
from autograder.selfstudy import ensure_built, work_dir, working_copy

STUDENT = "self"
PROGRESS = ".progress"

# What to try next, by verdict; generic on purpose: a hint never describes a hidden input.
HINTS = {
    "partial": "right on some hidden inputs only: test irregular shapes (non-powers of two, one and many blocks)",
    "failed": "wrong on the hidden inputs: run the test cell below it, then try other shapes and edge cases",
    "error": "your code raised an error when the grader called it: run the cell and its test cell",
    "timeout": "ran past the time limit: look for Python loops over elements or very many kernel launches",
    "crashed": "the process died: often an unmasked load or store outside a tensor",
    "memory": "ran out of memory: check what your code allocates or keeps",
    "output": "printed too much: remove prints from loops",
    "tampered": "a locked cell was changed or removed: copy it back from the release notebook",
    "missing": "a solution cell is missing: copy it back from the release notebook",
    "unanswered": "not attempted yet: fill the cell marked YOUR CODE HERE",
    "not_a_kernel": "the graded function must be a @triton.jit kernel built from tl.* operations only",
    "rejected": "the grader refused the code: it calls the library's version or a name it may not use",
    "invalid_notebook": "the file is not a notebook the grader can read (save it from JupyterLab as .ipynb)",
    "needs_gpu": "graded only on a GPU profile; left out of the total on this machine",
    "not_graded": "the grader or its machine failed on this item, not your code (the reason says what): "
                  "run the check again once that is fixed",
}


class CheckError(Exception):
    """The notebook could not be checked; the message says why and what to do."""


def progress_file(lab: str, work: Path | None = None) -> Path:
    return (work or work_dir()) / PROGRESS / f"{lab}.jsonl"


def check(lab: LabSpec, notebook_path: Path | None = None, *, course: Course | None = None,
          work: Path | None = None, profile: dict | None = None, seed: int | None = None,
          isolated: bool = True) -> dict:
    """Grade the learner's notebook of ``lab`` (default: its working copy); returns the record."""
    from fastdl_lab.checks import fresh_seed

    course = course or Course.default()
    path = Path(notebook_path or working_copy(lab.name, work)).expanduser().resolve()
    if not path.is_file():
        raise CheckError(f"no notebook at {path}: `{hints.workspace()}` makes the working copies, "
                         "or pass --notebook PATH")
    try:
        nb = notebook.read_notebook(path)
    except notebook.NotebookError as exc:
        raise CheckError(f"{path}: {exc}") from exc
    if lab.name not in lab_sources():
        raise CheckError(f"{lab.name} has no notebook in labs/")
    ensure_built(course, [lab.name])
    profile = profile or profiles.load()
    with tempfile.TemporaryDirectory(prefix="fastdl-check-") as tmp:
        # A copy of the build with a SQLite gradebook of its own (copy_build): whatever this run
        # writes stays in the copy, which is deleted with the folder.
        scratch = copy_build(course, Path(tmp) / "course")
        target = scratch.submitted(STUDENT, lab.name)
        target.parent.mkdir(parents=True)
        target.write_text(json.dumps(nb), encoding="utf-8")
        summary = batch.grade(scratch, [(lab.name, STUDENT)], profile=profile,
                              seed=fresh_seed() if seed is None else seed, isolated=isolated, execute=False)
    record = summary.graded[(lab.name, STUDENT)]
    record = {**record, "notebook": str(path), "failures": summary.failures}
    history = progress_file(lab.name, work)
    history.parent.mkdir(parents=True, exist_ok=True)
    with history.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return record


def history(lab: str, work: Path | None = None) -> list[dict]:
    """Every recorded check of ``lab``, oldest first; a line that cannot be read is skipped."""
    path = progress_file(lab, work)
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("items"), list):
            out.append(record)
    return out


def item_progress(records: list[dict], profile: str) -> dict[str, dict]:
    """Per item: its latest verdict, whether it ever passed, and the best speed-up measured on
    ``profile`` (None where no speed was measured there)."""
    out: dict[str, dict] = {}
    for record in records:
        for item in record["items"]:
            entry = out.setdefault(item["item"], {"ever_passed": False, "best_speedup": None})
            entry["latest"] = item
            entry["ever_passed"] |= item["status"] == "passed"
            speedup = (item.get("details") or {}).get("speedup")
            if record.get("profile") == profile and isinstance(speedup, (int, float)):
                entry["best_speedup"] = max(speedup, entry["best_speedup"] or 0.0)
    return out
