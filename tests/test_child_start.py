"""What a grading child loads before it runs anything: its own lab's spec and byte-compiled modules.

Every item of every submission starts a fresh sandboxed interpreter, so whatever it imports or
compiles on the way is paid once per item."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from autograder.engine.items import all_labs, lab_spec

ROOT = Path(__file__).resolve().parent.parent


def _imported_after(statement: str) -> list[str]:
    probe = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_child_imports_its_own_lab_and_no_other():
    modules = _imported_after("from autograder.engine.items import lab_spec; lab_spec('02_fusion')")
    labs = {m for m in modules if m.startswith("autograder.labs.lab")}
    assert labs == {"autograder.labs.lab02_fusion"}
    # What other labs' specs would have brought in: the distributed stack, pandas, the C++ builder.
    assert not {"fastdl_lab.distributed", "fastdl_lab.tabular", "fastdl_lab.custom", "pandas"} & set(modules)
    everything = _imported_after("from autograder.engine.items import all_labs; all_labs()")
    assert "fastdl_lab.distributed" in everything  # the probe can tell the two apart


def test_lab_spec_is_the_lab_all_labs_finds():
    for name, spec in all_labs().items():
        assert lab_spec(name) is spec


def _pyc_matches(source: Path) -> bool:
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.is_file():
        return False
    header = cached.read_bytes()[:16]
    flags = int.from_bytes(header[4:8], "little")
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    info = source.stat()
    return (header[:4] == importlib.util.MAGIC_NUMBER and flags == 0
            and mtime == int(info.st_mtime) & 0xFFFFFFFF and size == info.st_size & 0xFFFFFFFF)


def test_the_built_student_package_is_byte_compiled(course):
    sources = sorted((course.student_package / "fastdl_lab").rglob("*.py"))
    assert sources
    stale = [str(p.relative_to(course.student_package)) for p in sources if not _pyc_matches(p)]
    assert stale == []
