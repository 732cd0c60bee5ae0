"""The Makefile as make reads it: a target run or dry-run (make -n), and the grader's command line in a recipe."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_make(*args: str, cwd: Path | str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``make ARGS`` in ``cwd``. A make that started this test (make test) passes its flags down
    through the environment; they are left out here."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def dry_run(*args: str, cwd: Path | str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``make -n ARGS``: what the Makefile would run, run by nobody."""
    return run_make("-n", *args, cwd=cwd, env=env)


def grader_call(recipe: str) -> tuple[str, list[str]]:
    """The interpreter and the arguments of the one ``-m autograder`` command in ``recipe``."""
    calls = [shlex.split(line) for line in recipe.splitlines() if " -m autograder " in line]
    assert len(calls) == 1, f"expected one call of the grader in:\n{recipe}"
    words = calls[0]
    at = words.index("-m")
    return words[at - 1], words[at + 2:]
