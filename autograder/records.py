"""Grading records: every graded run leaves one JSON file per student and lab.

A record holds what a regrade needs to reproduce the score (profile, seed, versions, hardware)
and what an instructor needs to trust it (raw timings, every verdict with its reason).
"""

from __future__ import annotations

import json
import platform
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "triton", "nbgrader", "numpy", "fastdl-lab")


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


def write(records_dir: Path, lab: str, student: str, *, profile: str, seed: int, items: list[dict], nbgrader: dict) -> Path:
    path = records_dir / lab / f"{student}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "lab": lab,
        "student": student,
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "profile": profile,
        "seed": seed,
        "hardware": hardware(),
        "versions": versions(),
        "nbgrader": nbgrader,
        "items": items,
    }
    path.write_text(json.dumps(record, indent=2, default=str))
    return path


def read_all(records_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(records_dir.glob("*/*.json"))]
