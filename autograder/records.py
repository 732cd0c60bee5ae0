"""Grading records: every graded run leaves one JSON file per student and lab.

A record holds what a regrade needs to reproduce the score (profile, seed, versions, hardware)
and what an instructor needs to trust it (raw timings, every verdict with its reason).
"""

from __future__ import annotations

import json
import platform
import time
import unicodedata
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "triton", "nbgrader", "numpy", "fastdl-lab")
# A reason can quote what student code raised or printed: long enough to name the problem, short
# enough that no submission can flood a record, the report, the gradebook or the feedback.
MAX_REASON_CHARS = 300


def clean_reason(reason: object) -> str:
    """``reason`` capped, with control and format characters (NUL, escapes, bidi overrides, lone
    surrogates) replaced: they break CSV readers and UTF-8 writers, or disguise text on screen."""
    text = str(reason)
    cut = len(text) > MAX_REASON_CHARS
    text = "".join(ch if ch in "\n\t" or unicodedata.category(ch)[0] != "C" else "?" for ch in text[:MAX_REASON_CHARS])
    return text[: MAX_REASON_CHARS - 1] + "…" if cut else text


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def hardware() -> dict:
    from fastdl_lab import device

    return device.info().as_dict()


def write(records_dir: Path, lab: str, student: str, *, profile: str, seed: int, items: list[dict], nbgrader: dict,
          seconds: dict | None = None, worker: str = "", attempt: str = "") -> Path:
    path = records_dir / lab / f"{student}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "lab": lab,
        "student": student,
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "profile": profile,
        "seed": seed,
        # The submission's solution cells, digested: with the seed, what its hidden inputs came from.
        "attempt": attempt,
        "hardware": hardware(),
        "versions": versions(),
        "nbgrader": nbgrader,
        # Grading time of this submission (nbgrader's run, the engine, both) and where it ran.
        "seconds": seconds or {},
        "worker": worker,
        "items": [{**item, "reason": clean_reason(item["reason"])} for item in items],
    }
    path.write_text(json.dumps(record, indent=2, default=str))
    return path


def read_all(records_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(records_dir.glob("*/*.json"))]


def read_lab(records_dir: Path, lab: str) -> list[dict]:
    """The records of one lab, a student each."""
    return [json.loads(p.read_text()) for p in sorted((records_dir / lab).glob("*.json"))]
