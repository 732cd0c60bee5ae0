"""The grader's command lines start without the optional import that cost nbgrader 1.4 s per run."""

import importlib.util
import subprocess
import sys

import pytest

from autograder.course import tool_env

LOADED = ("import sys; import nbgrader.apps; "
          "print(sorted(m for m in autograder.startup.SKIPPED if sys.modules.get(m) is not None))")


def _loaded(skip: bool) -> str:
    first = "import autograder.startup; " + ("autograder.startup.skip_unused_imports(); " if skip else "")
    done = subprocess.run([sys.executable, "-c", first + LOADED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None, reason="the IRI checker is not installed")
def test_nbgrader_loads_the_iri_checker_unless_skipped():
    assert _loaded(skip=False) == "['rfc3987_syntax']"
    assert _loaded(skip=True) == "[]"


def test_nbgrader_main_is_nbgraders_command_line():
    done = subprocess.run([sys.executable, "-m", "autograder.nbgrader_main", "--version"], capture_output=True,
                          text=True, timeout=120, env=tool_env())
    assert done.returncode == 0, done.stderr
    assert "nbgrader version" in done.stdout
