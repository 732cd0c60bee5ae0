"""Hardware profiles: per-machine sizes, limits and thresholds for every graded item.

``autograder/profiles/<name>.json`` holds ``gpu`` (whether speed items are graded), ``limits``
for the sandbox and ``labs.<lab>.<item>`` parameters handed to the item's functions.
"""

from __future__ import annotations

import json
from pathlib import Path

from autograder.engine.sandbox import Limits

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load(name: str | None = None) -> dict:
    if name is None:
        from fastdl_lab import device

        name = device.profile_name()
    path = PROFILE_DIR / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"unknown hardware profile {name!r}; available: {', '.join(available())}")
    profile = json.loads(path.read_text())
    profile["name"] = name
    return profile


def limits(profile: dict) -> Limits:
    raw = profile.get("limits", {})
    return Limits(
        wall_s=raw.get("wall_s", 120),
        cpu_s=raw.get("cpu_s", 240),
        memory_bytes=int(raw.get("memory_mb", 6144)) << 20,
        limit_address_space=not profile.get("gpu", False),
        max_processes=raw.get("max_processes", 16),
        output_bytes=int(raw.get("output_kb", 256)) << 10,
    )


def item_params(profile: dict, lab: str, item: str) -> dict:
    return dict(profile.get("labs", {}).get(lab, {}).get(item, {}))
