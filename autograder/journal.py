"""The run journal: what a batch set out to grade and the final state of each submission.

One JSON line per event, appended by the single process that writes the grades, flushed and
synced before the next submission is written: a run that is killed leaves a journal that says
exactly which submissions reached a final state, and ``--resume`` grades only the others, with
the run's own seed and profile, so the resumed run scores as the whole run would have.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

GRADED = "graded"
NOT_GRADED = "not_graded"  # a grader fault or a worker lost twice: named in the reason
FINAL_STATES = (GRADED, NOT_GRADED)


@dataclass
class Run:
    path: Path
    run_id: str
    seed: int
    profile: str
    jobs: list[tuple[str, str]]  # (lab, student) in the order they were planned
    options: dict = field(default_factory=dict)  # how the run grades (nbgrader or not, which items)
    final: dict[tuple[str, str], dict] = field(default_factory=dict)  # the last final event of each job

    @property
    def remaining(self) -> list[tuple[str, str]]:
        return [job for job in self.jobs if job not in self.final]

    def finish(self, lab: str, student: str, state: str, **details) -> None:
        if state not in FINAL_STATES:
            raise ValueError(f"unknown final state {state!r}")
        event = {"event": "final", "lab": lab, "student": student, "state": state,
                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **details}
        _append(self.path, event)
        self.final[(lab, student)] = event


def _append(path: Path, event: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(event, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def journal_dir(course_root: Path) -> Path:
    return Path(course_root) / "runs"


def start(course_root: Path, *, seed: int, profile: str, jobs: list[tuple[str, str]], options: dict | None = None) -> Run:
    folder = journal_dir(course_root)
    folder.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
    run = Run(folder / f"{run_id}.jsonl", run_id, seed, profile, list(jobs), dict(options or {}))
    _append(run.path, {"event": "start", "run": run_id, "seed": seed, "profile": profile,
                       "jobs": [list(job) for job in jobs], "options": run.options})
    return run


def load(path: Path) -> Run:
    """Read a journal back; a line cut short by a kill (the last one) is ignored."""
    run = None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "start":
            run = Run(Path(path), event["run"], event["seed"], event["profile"], [tuple(j) for j in event["jobs"]],
                      event.get("options", {}))
        elif event.get("event") == "final" and run is not None:
            run.final[(event["lab"], event["student"])] = event
    if run is None:
        raise ValueError(f"{path}: not a grading journal (no start line)")
    return run


def latest_unfinished(course_root: Path, labs: set[str] | None = None) -> Run | None:
    """The newest run (of ``labs``, if given) that has submissions left to grade."""
    for path in sorted(journal_dir(course_root).glob("*.jsonl"), reverse=True):
        try:
            run = load(path)
        except (OSError, ValueError):
            continue
        if labs and not {lab for lab, _ in run.jobs} <= labs:
            continue
        return run if run.remaining else None
    return None
