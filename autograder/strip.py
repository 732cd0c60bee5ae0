"""Remove graded regions from Python source: what the student copy of the package is made of.

Notebooks are stripped by nbgrader itself; the package uses the same markers so one rule hides
every solution: the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` become a stub.
"""

from __future__ import annotations

import shutil
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("part of a graded exercise: see the lab notebook")'


class MarkerError(ValueError):
    pass


def strip_solutions(source: str, *, where: str = "<source>") -> str:
    out, inside, indent = [], False, ""
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise MarkerError(f"{where}:{number}: nested {BEGIN}")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}\n")
        elif stripped == END:
            if not inside:
                raise MarkerError(f"{where}:{number}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: {BEGIN} is never closed")
    return "".join(out)


def strip_package(src: Path, dest: Path) -> list[Path]:
    """Copy package ``src`` to ``dest`` with every solution region stubbed; returns stripped files."""
    if dest.exists():
        shutil.rmtree(dest)
    stripped = []
    for path in sorted(src.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text()
        new = strip_solutions(text, where=str(path))
        target.write_text(new)
        if new != text:
            stripped.append(target)
    return stripped
