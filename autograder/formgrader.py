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

The button shows only a spinner while that runs, so the formgrader's log (the service's output:
the hub's log, or the terminal of ``make hub``) says what is happening: a line when grading
starts, with what it usually takes, every line the grading prints as it prints it, stamped with
the seconds so far, and a last line with the time nbgrader's run and the engine took.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time

import nbformat
from nbconvert.preprocessors import Preprocessor
from traitlets import Bool, Unicode

from autograder import gradebook
from autograder.course import ROOT, Course
from autograder.progress import shown

# The engine grades every item of a lab in one run; lab 09 builds C++ on the way.
PIPELINE_TIMEOUT_S = 3600
# What one student's Autograde takes, for the log's first line; the README says the same
# ("A term, with the hub"). Measured through nbgrader's API, as the button calls it.
USUAL = "20-30 s for lab 00 on the 2-core machine, 35-45 s for a lab's first student"


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
        head = f"autograde of {lab} for {shown(student)}"
        self.log.info("%s: started, with the trusted engine (usually %s)", head, USUAL)
        started = time.monotonic()
        returncode, tail = self._run(argv, env, head, started)
        if returncode != 0:
            raise RuntimeError(f"the trusted grading of {lab} for {student} failed (exit {returncode}): "
                               f"{tail.strip()[-1500:]}")
        self.log.info("%s: done in %.1f s%s", head, time.monotonic() - started, _stages(course, lab, student))
        executed = course.autograded(student, lab)
        if executed.is_file():
            # The notebook as nbgrader's sandboxed run left it; otherwise (the kernel died) the
            # submission as sanitized, which the feedback shows with the engine's verdicts.
            nb = nbformat.read(executed, as_version=4)
        return nb, resources

    def _run(self, argv: list[str], env: dict, head: str, started: float) -> tuple[int, str]:
        """Run the grading command, logging each line it prints (progress goes to stderr, the table
        to stdout) as it comes; returns the exit code and the last lines, for an error."""
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        timed_out = threading.Event()

        def stop() -> None:
            # A run past the limit is ended; reading its output then stops at the end of the pipe.
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(PIPELINE_TIMEOUT_S, stop)
        watchdog.start()
        tail = collections.deque(maxlen=40)
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                self.log.info("%s, %.1f s: %s", head, time.monotonic() - started, line)
            returncode = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:  # the log itself failed: the grading must not outlive the button
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if timed_out.is_set():
            tail.append(f"stopped after {PIPELINE_TIMEOUT_S} s")
        return returncode, "\n".join(tail)


def _stages(course: Course, lab: str, student: str) -> str:
    """The grading record's own account of the job's time: nbgrader's run of the notebook, beside
    the engine's items, and the two together (the rest of the time is the command's start and the
    gradebook)."""
    try:
        seconds = json.loads((course.records / lab / f"{student}.json").read_text()).get("seconds", {})
    except (OSError, ValueError):
        return ""
    if not all(isinstance(seconds.get(key), (int, float)) for key in ("nbgrader", "engine", "total")):
        return ""
    return (f" (the submission {seconds['total']:.1f} s of it: the engine's items {seconds['engine']:.1f} s, "
            f"nbgrader's run of the notebook {seconds['nbgrader']:.1f} s beside them)")
