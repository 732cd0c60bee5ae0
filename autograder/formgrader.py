"""nbgrader's autograde in the course folder (formgrader's *Autograde* button, ``nbgrader autograde``)
grades through the trusted engine.

Formgrader's button runs nbgrader's Autograde converter in the formgrader's own process, with the
course's ``nbgrader_config.py``. There the converter's Execute step is ``TrustedAutograde``, which
hands the submission to ``python -m autograder autograde LAB --student S``: nbgrader's sandboxed run
of the notebook (in a scratch course whose config executes, never this step) and then the engine,
whose verdicts it writes into the gradebook, the records and the autograded notebook. The converter
then carries on with that notebook, and with no SaveAutoGrades step: nothing of nbgrader's own
scoring is written over the engine's. A submission autograded from formgrader therefore ends with
exactly the scores ``autograder autograde`` gives it, with a fresh secret seed of its own run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
from nbconvert.preprocessors import Preprocessor
from traitlets import Bool, Unicode

from autograder import gradebook
from autograder.course import ROOT, Course

# The engine grades every item of a lab in one run; lab 09 builds C++ on the way.
PIPELINE_TIMEOUT_S = 3600


class TrustedAutograde(Preprocessor):
    # nbconvert preprocessors are off unless enabled; this one stands in for nbgrader's Execute.
    enabled = Bool(True).tag(config=True)
    course_root = Unicode("", help="the course folder the gradebook and records belong to").tag(config=True)
    profile = Unicode("", help="hardware profile to grade with (empty: this machine's)").tag(config=True)

    def preprocess(self, nb, resources):
        info = resources.get("nbgrader", {})
        lab, student = info.get("assignment"), info.get("student")
        if not (self.course_root and lab and student):
            raise RuntimeError("TrustedAutograde needs the course folder (c.TrustedAutograde.course_root), "
                               "the assignment and the student")
        course = Course(self.course_root, info.get("db_url") or None)
        argv = [sys.executable, "-m", "autograder", "--course", str(course.root), "autograde", lab,
                "--student", student]
        if self.profile:
            argv += ["--profile", self.profile]
        # The URL travels in the environment, not on the command line, where `ps` would show a password.
        env = {**os.environ, gradebook.URL_VAR: course.db_url}
        self.log.info("grading %s of %s with the trusted engine", lab, student)
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PIPELINE_TIMEOUT_S)
        for line in done.stdout.splitlines():
            self.log.info("%s", line)
        if done.returncode != 0:
            raise RuntimeError(f"the trusted grading of {lab} for {student} failed (exit {done.returncode}): "
                               f"{done.stderr.strip()[-1500:]}")
        executed = course.autograded(student, lab)
        if executed.is_file():
            # The notebook as nbgrader's sandboxed run left it; otherwise (the kernel died) the
            # submission as sanitized, which the feedback shows with the engine's verdicts.
            nb = nbformat.read(executed, as_version=4)
        return nb, resources
