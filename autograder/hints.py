"""The commands the grader prints for someone to run next, spelled so that they run as printed.

A bare ``python -m autograder ...`` works only where ``python`` is the course's interpreter: in a
shell without the venv activated it stops at ``No module named 'nbgrader'``. So a learner is sent
to the Makefile's self-study targets (``make grade LAB=02``, ``make progress``), which make the
venv first and use the working folder the Makefile sets, and every other command names the
interpreter running now by its path (``.venv/bin/python -m autograder ...``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from autograder.course import ROOT

UNSAFE_MAKE_VAR = "UNSAFE"


def python() -> str:
    """This interpreter as one shell word: relative to the working directory when it lies below it
    (``.venv/bin/python``), else its full path. Not resolved: the venv's ``python`` is a link whose
    target would start without the venv's packages."""
    exe = os.path.abspath(sys.executable)
    relative = os.path.relpath(exe, os.getcwd())
    word = exe if relative.startswith(os.pardir) else relative
    # A word without a slash would be looked up on PATH, which is what went wrong in the first place.
    return shlex.quote(word if os.sep in word else os.path.join(os.curdir, word))


def autograder(args: str) -> str:
    """``ARGS`` (already quoted for the shell) as a command of this interpreter's grader."""
    return f"{python()} -m autograder {args}"


def make_reaches_this() -> bool:
    """Whether the Makefile's self-study targets act on what this process acts on: the
    repository's Makefile and ``make`` are there, and the working folder is the Makefile's own."""
    from autograder.selfstudy import work_dir

    return ((ROOT / "Makefile").is_file() and shutil.which("make") is not None
            and work_dir() == (ROOT / "work").resolve())


def make(target: str, **variables: object) -> str:
    """``make TARGET VAR=value ...``, with ``-C ROOT`` when run from another folder."""
    where = [] if Path.cwd().resolve() == ROOT else ["-C", str(ROOT)]
    return shlex.join(["make", *where, target, *(f"{name}={value}" for name, value in variables.items())])


def _learners(args: str) -> str:
    """A self-study command of the grader, in the working folder this process uses."""
    from autograder.selfstudy import WORK_VAR, work_dir

    chosen = f"{WORK_VAR}={shlex.quote(str(work_dir()))} " if os.environ.get(WORK_VAR) else ""
    return chosen + autograder(args)


def check(lab: str, *, unsafe: bool = False) -> str:
    """The command that self-checks the working copy of ``lab`` (a number, topic or name);
    ``unsafe`` checks it without the sandbox, for the learner's own notebook only."""
    if make_reaches_this():
        return make("grade", LAB=lab, **({UNSAFE_MAKE_VAR: 1} if unsafe else {}))
    return _learners(shlex.join(["check", lab, *(["--unsafe-no-isolation"] if unsafe else [])]))


def progress() -> str:
    """The command that shows the learner's progress in every lab."""
    return make("progress") if make_reaches_this() else _learners("progress")


def workspace() -> str:
    """The command that makes the learner's working copies (``make lab`` then opens JupyterLab on them)."""
    return make("lab") if make_reaches_this() else _learners("workspace")
