"""Writing the trusted engine's scores into nbgrader's gradebook.

Each item's score goes into ``manual_score`` of its test cell, which nbgrader ranks above its
automatic score (zero: nbgrader's run leaves test cells unrun, ``autograder.execute``), so
formgrader, feedback and grade exports all show the engine's figure. The reasons become comments on the item's solution cells.
"""

from __future__ import annotations

import html
import re

from nbgrader.api import Gradebook, MissingEntry

from autograder.engine.items import LabSpec
from autograder.records import clean_reason

# nbgrader's feedback renders comments as Markdown, raw HTML and links included: a reason that
# quotes student output must come out as text. HTML is escaped; backslashes and brackets are
# escaped so that no link or image can be formed.
_MARKDOWN_SPECIAL = re.compile(r"([\\\[\]])")


def comment_line(item: str, status: str, reason: object) -> str:
    text = html.escape(f"{item}: {status} - {clean_reason(reason)}", quote=False)
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def write_scores(db_url: str, lab: LabSpec, student: str, results: list[dict]) -> None:
    with Gradebook(db_url) as gb:
        gb.update_or_create_student(student)
        try:
            gb.find_submission(lab.name, student)
        except MissingEntry:
            # nbgrader could not execute the notebook (e.g. a crashed kernel): the engine's
            # verdicts still stand, so the submission is created for them.
            gb.add_submission(lab.name, student)
        comments: dict[str, list[str]] = {}
        for result in results:
            item = lab.item(result["item"])
            grade = gb.find_grade(item.name, lab.name, lab.name, student)
            grade.manual_score = result["score"] if result["counted"] else 0.0
            grade.needs_manual_grade = False
            for cell in item.cells:
                comments.setdefault(cell, []).append(comment_line(item.name, result["status"], result["reason"]))
        for cell, lines in comments.items():
            try:
                comment = gb.find_comment(cell, lab.name, lab.name, student)
            except MissingEntry:
                continue
            comment.auto_comment = "\n".join(lines)
        gb.db.commit()
