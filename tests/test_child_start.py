"""What a grading child loads before it runs anything: its own lab's spec and byte-compiled modules.

Every item of every submission starts a fresh sandboxed interpreter, so whatever it imports or
compiles on the way is paid once per item."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from autograder import profiles
from autograder.engine import channel, grade
from autograder.engine.items import all_labs, lab_spec
from autograder.submissions import reference_solutions

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


# Runs a grading child's main in this interpreter, then reports whether Triton hashed its own
# installation on the way (the function Triton caches it in, as Triton defined it).
_KEY_PROBE = """
import json, os, sys
from triton.runtime import cache
hashed_here = cache.triton_key
from autograder.engine import child
status = child.main(sys.argv[1])
print(json.dumps([status, hashed_here.cache_info().misses, os.listdir(os.environ["TRITON_CACHE_DIR"])]))
"""


def _reference_workdir(course, profile, lab_name: str, item_name: str) -> grade._Workdir:
    """The work directory the parent makes for one item of the reference submission."""
    lab = lab_spec(lab_name)
    item = lab.item(item_name)
    params = profiles.item_params(profile, lab.name, item.name)
    return grade._Workdir(lab, item, reference_solutions(course, lab.name), item.make_inputs(1, params),
                          mode="check", params=params)


def _run_kernel_child(course, profile, tmp_path, drop_key: bool) -> tuple[int, int, list]:
    work = _reference_workdir(course, profile, "01_gemm", "matmul_fp32")
    try:
        if drop_key:
            job = json.loads(Path(work.path, "job.json").read_text())
            del job["triton_key"]
            Path(work.path, "job.json").write_text(json.dumps(job))
        env = grade._child_env(grade.Sandbox(course.student_package, profile, isolated=False), work.path)
        cache = tmp_path / ("cache-without-key" if drop_key else "cache")
        cache.mkdir()
        endpoint = channel.Endpoint(work.path)  # the grader's end of the line the child opens first
        done = subprocess.run([sys.executable, "-c", _KEY_PROBE, work.path], capture_output=True, text=True,
                              env={**env, "TRITON_CACHE_DIR": str(cache)}, cwd=work.path, timeout=120)
        received = endpoint.close()
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(received.outputs) == 1 and not received.errors
        return tuple(json.loads(done.stdout.splitlines()[-1]))
    finally:
        work.remove()


def test_a_kernel_child_compiles_with_the_graders_triton_key(course, cpu, tmp_path):
    from triton.runtime.cache import triton_key

    status, hashed, compiled = _run_kernel_child(course, cpu, tmp_path, drop_key=False)
    assert status == 0
    assert compiled  # the kernel was compiled for sm_90, as every kernel item's is
    assert hashed == 0  # without hashing Triton's 460 MB
    status, hashed, compiled = _run_kernel_child(course, cpu, tmp_path, drop_key=True)
    assert (status, hashed) == (0, 1) and compiled  # the probe sees the hash when the key is not given
    assert grade._triton_key() == triton_key()


def test_every_extracted_item_checks_the_grad_descriptors(course, cpu):
    from autograder.engine.artefacts import GRAD_DESCRIPTORS

    work = _reference_workdir(course, cpu, "07_distributed", "zero1")
    try:
        assert work.job["artefact_module"] and set(GRAD_DESCRIPTORS) <= set(work.job["instruments"])
        assert set(lab_spec("07_distributed").item("zero1").instruments) <= set(work.job["instruments"])
    finally:
        work.remove()
