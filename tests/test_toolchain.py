"""The sandbox shows the compilers wherever they are installed (autograder/engine/toolchain.py).

The lent GPU image keeps gcc under /opt/gcc, which a sandbox of /usr and the Python installation
lacks: every Triton launch (its launcher is built with the C compiler) and lab 09's C++ build
failed there. Here a compiler is put under an equally unusual prefix, with its assembler under
another, and a sandboxed child builds and runs a C program with it; without the binds it cannot.
"""

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from autograder.engine import bwrap, prefork, toolchain
from autograder.engine.sandbox import Limits, run_sandboxed

ROOT = Path(__file__).resolve().parent.parent
LIMITS = Limits(wall_s=60, cpu_s=60, memory_bytes=2 << 30, max_processes=16, output_bytes=64_000)
PROGRAM = "#include <stdio.h>\nint main(void) { printf(\"built in the sandbox: %d\\n\", 6 * 7); return 0; }\n"
BUILD_AND_RUN = f"""
import os, subprocess
open("/job/hello.c", "w").write({PROGRAM!r})
subprocess.run([os.environ["CC"], "/job/hello.c", "-o", "/job/hello"], check=True)
print(subprocess.run(["/job/hello"], capture_output=True, text=True, check=True).stdout)
"""

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("as") is None,
                               reason="needs gcc and as on this machine to wrap")


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def unusual_gcc(tmp_path):
    """A C compiler at <tmp>/opt/gcc/bin/gcc whose assembler is <tmp>/opt/binutils/bin/as, as a
    relocated toolchain would have them: neither is under /usr."""
    base = tmp_path / "toolchains"
    binutils = base / "opt" / "binutils" / "bin"
    _executable(binutils / "as", f"#!/bin/sh\necho assembled by the relocated as >&2\nexec {shutil.which('as')} \"$@\"\n")
    # -B makes the driver look for its programs (the assembler) in that folder first.
    gcc = _executable(base / "opt" / "gcc" / "bin" / "gcc", f"#!/bin/sh\nexec {shutil.which('gcc')} -B{binutils}/ \"$@\"\n")
    # Every folder on the way must be enterable by the sandbox's uid (pytest makes its own 0700).
    for folder in [base, *base.rglob("*")]:
        if folder.is_dir():
            folder.chmod(0o755)
    return gcc


def test_an_installation_is_the_folder_above_its_layout():
    assert toolchain.install_prefix("/opt/gcc/bin/gcc") == "/opt/gcc"
    assert toolchain.install_prefix("/opt/gcc/libexec/gcc/x86_64-linux-gnu/13/cc1") == "/opt/gcc"
    assert toolchain.install_prefix("/opt/conda/envs/course/bin/x86_64-conda-linux-gnu-cc") == "/opt/conda/envs/course"
    assert toolchain.install_prefix("/usr/local/cuda-13.0/targets/x86_64-linux/include") == "/usr/local/cuda-13.0"


def test_every_link_on_the_way_to_a_compiler_is_found(tmp_path):
    (tmp_path / "real" / "bin").mkdir(parents=True)
    real = _executable(tmp_path / "real" / "bin" / "gcc-13", "#!/bin/sh\n")
    (tmp_path / "alternatives").mkdir()
    (tmp_path / "alternatives" / "cc").symlink_to(real)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cc").symlink_to("../alternatives/cc")
    assert toolchain.link_chain(str(tmp_path / "bin" / "cc")) == [
        str(tmp_path / "bin" / "cc"), str(tmp_path / "alternatives" / "cc"), str(real)]


@needs_gcc
def test_a_compiler_under_an_unusual_prefix_and_the_assembler_it_runs_are_bound(unusual_gcc):
    opt = unusual_gcc.parent.parent.parent
    found = toolchain.find({"PATH": "/usr/bin:/bin", "CC": str(unusual_gcc)}, shown=bwrap.shown())
    assert found.c == str(unusual_gcc)
    assert found.binds == (str(opt / "binutils"), str(opt / "gcc"))
    # A machine whose compilers are all under /usr needs nothing more than the sandbox shows.
    assert toolchain.find({"PATH": "/usr/bin:/bin"}, shown=bwrap.shown()).binds == ()


def test_no_bind_holds_the_repository_the_home_or_a_whole_top_level_folder(tmp_path):
    home = os.path.realpath(os.path.expanduser("~"))
    shown = bwrap.shown()
    # A compiler in the grader's own bin folder: only the file, never the home around it.
    assert toolchain._bind_for(f"{home}/bin/gcc", list(shown)) == f"{home}/bin/gcc"
    assert toolchain._bind_for("/opt/bin/gcc", list(shown)) == "/opt/bin/gcc"
    # Nothing inside the repository: the course, its gradebook and the solutions live there.
    assert toolchain._bind_for(str(ROOT / "build" / "tools" / "bin" / "gcc"), list(shown)) is None
    assert toolchain._bind_for("/usr/lib/gcc/x86_64-linux-gnu/12/cc1", list(shown)) is None


def test_a_gpu_profile_without_a_c_compiler_is_refused_by_name(tmp_path):
    found = toolchain.find({"PATH": str(tmp_path)}, shown=bwrap.shown())
    assert found.c is None
    assert "no C compiler" in found.problems(gpu=True)[0]
    assert found.problems(gpu=False) == []


@pytest.fixture(params=["bubblewrap", "fork server"])
def server(request):
    if request.param == "bubblewrap":
        yield None
        return
    if not prefork.enabled():
        pytest.skip("the fork server is used only where the grader runs as root")
    server = prefork.ForkServer({"PATH": "/usr/bin:/bin"}, preload=())
    yield server
    server.close()


def _build_in_sandbox(tmp_path, gcc, server):
    work = tmp_path / "job"
    work.mkdir()
    bwrap.prepare_workdir(str(work))
    env = {"PATH": "/usr/bin:/bin", "CC": str(gcc), "PYTHONDONTWRITEBYTECODE": "1"}
    return run_sandboxed([bwrap.PYTHON, "-c", BUILD_AND_RUN], limits=LIMITS, cwd=str(work), env=env,
                         view=bwrap.View(str(work)), server=server)


@needs_gcc
def test_a_sandboxed_child_builds_and_runs_c_with_a_compiler_under_an_unusual_prefix(tmp_path, unusual_gcc, server,
                                                                                      monkeypatch):
    bwrap.check()
    # The child's environment comes from the grader's: the binds are found for the grader's CC.
    monkeypatch.setenv("CC", str(unusual_gcc))
    result = _build_in_sandbox(tmp_path, unusual_gcc, server)
    assert result.status == "ok" and result.sandboxed, result.output_tail[-2000:]
    assert "built in the sandbox: 42" in result.output_tail
    assert "assembled by the relocated as" in result.output_tail


@needs_gcc
def test_without_the_binds_the_same_child_finds_no_compiler(tmp_path, unusual_gcc, monkeypatch):
    """The sandbox as it was on the GPU image: /usr and the Python installation only."""
    bwrap.check()
    monkeypatch.setenv("CC", str(unusual_gcc))
    monkeypatch.setattr(toolchain, "find", lambda *args, **kwargs: toolchain.Toolchain(None, None, None, (), ()))
    result = _build_in_sandbox(tmp_path, unusual_gcc, None)
    assert result.status == "error"
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{unusual_gcc}'" in result.output_tail


def test_the_command_line_says_what_it_binds():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "autograder.engine.toolchain"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert "C compiler:" in done.stdout and "CUDA toolkit:" in done.stdout, done.stderr
