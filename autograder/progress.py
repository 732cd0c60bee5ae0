"""What grading shows while it runs: a live bar on a terminal, one plain line per submission otherwise.

Each finished submission prints its score and time (a line is what a CI log or a file keeps; on a
terminal the lines scroll above the bar). The closing summary says first how many items could not
be graded, then counts verdicts by status and names every submission that could not be graded.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import TextIO


def shown(text: str) -> str:
    """``text`` on one terminal line: student folder names and output must not move the cursor,
    recolour or add rows to what the instructor reads."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def describe(record: dict) -> str:
    """One submission's outcome: ``lab student: 7/13 (2 points need a GPU) in 9.1 s``."""
    counted = [i for i in record["items"] if i.get("counted", True)]
    left_out = sum(i["max_score"] for i in record["items"] if not i.get("counted", True))
    not_graded = [i for i in record["items"] if i["status"] == "not_graded"]
    head = f"{record['lab']} {shown(record['student'])}"
    seconds = record.get("seconds", {}).get("total")
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    if not_graded:
        return f"{head}: NOT GRADED ({shown(not_graded[0]['reason'][:120])}){took}"
    score = sum(i["score"] for i in counted)
    total = sum(i["max_score"] for i in counted)
    gpu = f" ({left_out:g} points need a GPU)" if left_out else ""
    return f"{head}: {score:.3g}/{total:g}{gpu}{took}"


class Progress:
    """Call with (done, total, record) after each submission, or ``line`` with any text for other
    work per student (feedback), ``note`` for the batch's own steps; ``close`` when the batch ends."""

    def __init__(self, total: int, *, stream: TextIO | None = None, desc: str = "grading"):
        self.stream = stream or sys.stderr
        self.done = 0
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="submission", file=self.stream, dynamic_ncols=True)

    def __call__(self, done: int, total: int, record: dict) -> None:
        self.line(done, total, describe(record))

    def line(self, done: int, total: int, text: str) -> None:
        self.done = done
        line = f"[{done}/{total}] {text}"
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
            self.bar.update(1)
        else:
            print(line, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line about the batch rather than a submission (what it prepares before grading)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary_lines(records: list[dict]) -> list[str]:
    """Verdicts by status across the batch, most common first, and the submissions not graded.
    Items the grader could not grade (a worker lost, a fault of the machine: no compiler, no GPU
    driver, a sandbox that would not start) come first, counted: every other score stands, but
    those items scored 0 through no fault of the students."""
    statuses = Counter(item["status"] for record in records for item in record["items"])
    lost = [r for r in records if any(i["status"] == "not_graded" for i in r["items"])]
    lines = []
    if lost:
        first = next(i["reason"] for r in lost for i in r["items"] if i["status"] == "not_graded")
        lines.append(f"NOT GRADED: {statuses['not_graded']} item(s) of {len(lost)} submission(s), a fault of the grader "
                     f"or its machine, not of the students (first: {shown(first[:160])}); fix it and regrade them")
    lines.append(f"{len(records)} submission(s): "
                 + ", ".join(f"{status} {count}" for status, count in statuses.most_common()))
    if lost:
        lines.append(f"{len(lost)} not graded (regrade them with --student):")
        lines += [f"  - {describe(r)}" for r in lost]
    return lines
