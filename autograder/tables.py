"""What people read on a terminal: grade tables, self-check verdicts and progress, 100 columns wide.

Scores are rounded to two decimals here only (the CSV and the records keep full precision); a long
reason wraps under its row, and only its first lines are shown (the CSV has all of it).
"""

from __future__ import annotations

import textwrap

from autograder import pipeline
from autograder.engine.grade import UNISOLATED
from autograder.hints import check as check_command
from autograder.progress import shown

WIDTH = 100
REASON_LINES = 2
INDENT = "    "


def score_text(value: float) -> str:
    """``2.6667`` -> ``2.67``, ``4.0`` -> ``4``: for people; the CSV keeps every digit."""
    return f"{float(value):.2f}".rstrip("0").rstrip(".")


def fit(text: str, width: int) -> str:
    text = shown(str(text))
    return text if len(text) <= width else text[: width - 1] + "…"


def wrapped(text: str, *, lines: int = REASON_LINES, indent: str = INDENT, note: str = "",
            width: int = WIDTH) -> list[str]:
    """``text`` wrapped to ``width`` under a row; past ``lines`` lines it is cut and ``note`` says where the rest is."""
    out = textwrap.wrap(shown(text), width - len(indent), break_long_words=True) or []
    if len(out) > lines:
        out = out[:lines]
        out[-1] = fit(out[-1], width - len(indent) - len(note) - 1) + (f" {note}" if note else "")
    return [indent + line for line in out]


def _reason_shown(row: dict) -> bool:
    return bool(row["reason"]) and not (row["status"] == "passed" and row["reason"] == "correct")


def grade_table(rows: list[dict]) -> str:
    """One line per student, lab and item, its reason wrapped beneath, then each total."""
    head = f"{'student':<16} {'lab':<18} {'item':<22} {'score':>9}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        score = f"{score_text(r['score'])}/{score_text(r['max_score'])}"
        lines.append(f"{fit(r['student'], 16):<16} {fit(r['lab'], 18):<18} {fit(r['item'], 22):<22} {score:>9}  "
                     f"{fit(r['status'], 14)}")
        if _reason_shown(r):
            lines += wrapped(r["reason"], note="(all of it in the CSV)")
    lines.append("")
    for (student, lab), t in sorted(pipeline.totals(rows).items()):
        note = f"  ({score_text(t['left_out'])} points need a GPU: left out)" if t["left_out"] else ""
        lines.append(f"total {fit(student, 16):<16} {fit(lab, 18):<18} {score_text(t['score'])}/{score_text(t['max'])}{note}")
    return "\n".join(lines)


def check_report(record: dict, hints: dict[str, str], *, width: int = WIDTH) -> str:
    """A self-check: one line per item with its verdict, the reason and a hint beneath, within ``width`` columns."""
    lines = [f"{'item':<24} {'score':>9}  status"]
    for item in record["items"]:
        score = f"{score_text(item['score'])}/{score_text(item['max_score'])}"
        lines.append(f"{fit(item['item'], 24):<24} {score:>9}  {fit(item['status'], 14)}")
        if item["status"] != "passed" or item["reason"] not in ("", "correct"):
            lines += wrapped(item["reason"], lines=3, width=width)
        if item["status"] != "passed" and item["status"] in hints:
            lines += wrapped("hint: " + hints[item["status"]], lines=2, width=width)
    counted = [i for i in record["items"] if i.get("counted", True)]
    left_out = sum(i["max_score"] for i in record["items"] if not i.get("counted", True))
    total = f"total {score_text(sum(i['score'] for i in counted))}/{score_text(sum(i['max_score'] for i in counted))}"
    lines += ["", total + (f" ({score_text(left_out)} points need a GPU: left out on this profile)" if left_out else "")]
    return "\n".join(lines)


def progress_view(labs: dict[str, dict[str, dict] | None], profile: str) -> str:
    """Per lab (None: never checked), per item: the latest verdict, whether it ever passed, and the
    best speed-up measured on ``profile``."""
    lines = [f"progress on the {profile} profile (self-checks, not grades)", ""]
    for lab, items in labs.items():
        if not items:
            lines.append(f"{lab:<20} not checked yet: {check_command(lab.split('_')[0])}")
            continue
        passing = sum(1 for e in items.values() if e["latest"]["status"] == "passed")
        gradable = sum(1 for e in items.values() if e["latest"]["status"] != "needs_gpu")
        lines.append(f"{lab:<20} {passing}/{gradable} items pass")
        for name, e in items.items():
            latest = e["latest"]
            if latest["status"] == "needs_gpu":
                state = "needs a GPU"
            else:
                state = latest["status"] + ("" if latest["status"] == "passed" or not e["ever_passed"]
                                            else " (passed before)")
            if str(latest.get("reason", "")).startswith(UNISOLATED):
                state += ", UNSAFE check"  # the latest check ran without the sandbox (make grade UNSAFE=1)
            speed = f"best speed-up {e['best_speedup']:.2f}x" if e["best_speedup"] is not None else ""
            lines.append(f"  {fit(name, 24):<24} {score_text(latest['score'])}/{score_text(latest['max_score']):<6} "
                         f"{state:<28} {speed}".rstrip())
    return "\n".join(lines)
