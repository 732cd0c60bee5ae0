"""The compilers course code runs inside the sandbox, found wherever this machine installed them.

Three things compile inside a sandbox: Triton builds a small C launcher the first time a kernel
runs on a GPU, lab 09 builds C++ (and CUDA) extensions, and ``torch.compile`` on the CPU builds
C++. The sandbox shows ``/usr``, the Python installation and little else (``bwrap.py``), so a
toolchain installed anywhere else (``/opt/gcc`` on the lent GPU image, a conda environment's
compilers, a CUDA toolkit under ``/opt``) would exist for the grader and not for its children:
every sandboxed build would fail with "No such file or directory".

:func:`find` resolves what a child would run with the grader's environment (which the child
inherits: ``PATH``, ``CC``, ``CXX``, ``CUDA_HOME``): the C and C++ compilers (``CC``, ``CXX``,
then ``cc``, ``gcc``, ``clang``, ``c++``, ``g++``, ``clang++`` on ``PATH``), every link on the way
to each (``/etc/alternatives`` included), the programs each compiler runs and the folders it
searches (asked of the compiler itself), the CUDA toolkit torch would build with, and the library
folders the environment points at. :func:`binds` gives the install prefixes that hold them and
that the sandbox does not already show: ``bwrap.plan`` binds each one read-only.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

C_COMPILERS = ("cc", "gcc", "clang")
CXX_COMPILERS = ("c++", "g++", "clang++")
# What a compiler driver runs besides itself: the compiler proper, the assembler, the linker.
HELPERS = ("cc1", "cc1plus", "as", "ld", "collect2")
# Folder names that mark the top of an installation: /opt/gcc/bin/gcc, /opt/gcc/libexec/gcc/...
# and /opt/gcc/include all belong to /opt/gcc.
LAYOUT = frozenset({"bin", "sbin", "lib", "lib32", "lib64", "libexec", "include", "share", "targets", "nvvm"})
# Folders the environment hands to course code (bwrap.HOST_VARS): a path there must exist inside.
PATH_VARS = ("LD_LIBRARY_PATH", "TRITON_LIBCUDA_PATH", "TRITON_PTXAS_PATH", "TRITON_CUDART_PATH",
             "TRITON_CUDACRT_PATH")
ASK_TIMEOUT_S = 20


class ToolMissing(RuntimeError):
    """A tool the grading profile needs is not on this machine: the machine's fault, named."""


@dataclass(frozen=True)
class Toolchain:
    c: str | None  # the C compiler Triton would pick (CC, else gcc, else clang), as found on PATH
    cxx: str | None  # the C++ compiler torch's extensions would pick (CXX, else c++)
    cuda_home: str | None  # the CUDA toolkit torch.utils.cpp_extension would use
    paths: tuple[str, ...]  # every file and folder found that a build inside may touch
    binds: tuple[str, ...]  # the install prefixes holding them that the sandbox must show

    def problems(self, *, gpu: bool) -> list[str]:
        """Why a profile cannot compile what it must, one sentence each."""
        if gpu and self.c is None:
            return ["no C compiler (CC, gcc or clang on the grader's PATH): Triton builds its launcher with one the "
                    "first time a kernel runs, so no kernel item could be graded; install gcc or set CC"]
        return []


def _first_word(command: str) -> str | None:
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return words[0] if words else None


def _which(name: str | None, path: str | None) -> str | None:
    return shutil.which(name, path=path) if name else None


def link_chain(path: str) -> list[str]:
    """``path`` and every link it passes through to the file it names (``/usr/bin/cc``,
    ``/etc/alternatives/cc``, ``/usr/bin/gcc``): a sandbox that lacks any of them cannot follow it."""
    chain, seen = [os.path.abspath(path)], set()
    current = chain[0]
    while len(chain) < 40:
        # A link inside a linked folder: resolve the folders first, then the last step.
        parent = os.path.realpath(os.path.dirname(current))
        here = os.path.join(parent, os.path.basename(current))
        if here != current:
            chain.append(here)
        if not os.path.islink(here) or here in seen:
            break
        seen.add(here)
        current = os.path.normpath(os.path.join(parent, os.readlink(here)))
        chain.append(current)
    real = os.path.realpath(path)
    return list(dict.fromkeys(chain + [real]))


def _ask(compiler: str, *args: str, environ: dict[str, str], stdin: str | None = None) -> str:
    """What ``compiler args`` prints (stdout and stderr), or "" where it cannot run."""
    try:
        done = subprocess.run([compiler, *args], input=stdin, capture_output=True, text=True,
                              timeout=ASK_TIMEOUT_S, env={**os.environ, **environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout + done.stderr


def _search_dirs(output: str) -> list[str]:
    """The folders ``-print-search-dirs`` names: its install folder, programs and libraries."""
    found = []
    for line in output.splitlines():
        key, _, value = line.partition(": ")
        if key == "install":
            found.append(value.strip())
        elif key in ("programs", "libraries"):
            found += value.strip().lstrip("=").split(os.pathsep)
    return found


def _include_dirs(output: str) -> list[str]:
    """The folders a preprocessor run with ``-v`` says it searches for ``#include``."""
    lines, inside, found = output.splitlines(), False, []
    for line in lines:
        if line.startswith("#include ") and "search starts here" in line:
            inside = True
        elif line.startswith("End of search list"):
            inside = False
        elif inside and line.startswith(" "):
            found.append(line.strip().split(" (")[0])
    return found


def _compiler_paths(compiler: str, language: str, environ: dict[str, str]) -> list[str]:
    """The programs ``compiler`` runs and the folders it searches, as it reports them."""
    found = []
    for helper in HELPERS:
        name = _ask(compiler, f"-print-prog-name={helper}", environ=environ).strip()
        # A bare name means the driver looks the program up on PATH.
        found.append(name if os.path.isabs(name) else _which(name, environ.get("PATH", os.defpath)) or "")
    found += _search_dirs(_ask(compiler, "-print-search-dirs", environ=environ))
    found += _include_dirs(_ask(compiler, "-E", "-v", "-x", language, "-", environ=environ, stdin=""))
    return found


def _cuda_home(environ: dict[str, str], path_var: str | None) -> str | None:
    """The toolkit ``torch.utils.cpp_extension`` builds CUDA with: CUDA_HOME or CUDA_PATH, else
    the folder above nvcc's on PATH, else /usr/local/cuda."""
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if not home:
        nvcc = _which("nvcc", path_var)
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else "/usr/local/cuda"
    return home if os.path.isdir(home) else None


def install_prefix(path: str) -> str:
    """The installation ``path`` belongs to: the folder above its first ``bin``, ``lib``,
    ``include``, ... (``/opt/gcc/libexec/gcc/x86_64-linux-gnu/13/cc1`` -> ``/opt/gcc``), else the
    folder it is in (or itself, for a folder)."""
    parts = Path(path).parts
    for i, part in enumerate(parts[1:], 1):
        if part in LAYOUT:
            return str(Path(*parts[:i]))
    return path if os.path.isdir(path) else os.path.dirname(path)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _repository() -> str:
    return str(Path(__file__).resolve().parents[2])


def _private() -> list[str]:
    """Folders no bind may hold: the repository (its solutions, and the course with its gradebook
    and records by default), the course folder where it is elsewhere, and the grader's home."""
    found = [_repository(), os.path.realpath(os.path.expanduser("~"))]
    if os.environ.get("FASTDL_COURSE_DIR"):
        found.append(os.path.realpath(os.environ["FASTDL_COURSE_DIR"]))
    return found


def _bind_for(path: str, shown: list[str]) -> str | None:
    """What to bind so that ``path`` exists inside: its install prefix, or only the path itself
    where the prefix is a top-level folder or holds a private folder (:func:`_private`); None where
    the sandbox shows it already, or where it lies inside the repository."""
    if any(_under(path, folder) for folder in shown) or _under(path, _repository()):
        return None
    for candidate in (install_prefix(path), path):
        if candidate.count("/") >= 2 and not any(_under(private, candidate) for private in _private()):
            return candidate
    return None


def _outermost(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths)):
        if not any(_under(path, outer) for outer in kept):
            kept.append(path)
    return kept


def _environment_paths(environ: dict[str, str]) -> list[str]:
    found = []
    for var in PATH_VARS:
        found += [p for p in environ.get(var, "").split(os.pathsep) if os.path.isabs(p)]
    return found


def _resolve(environ: dict[str, str], shown: tuple[str, ...]) -> Toolchain:
    path_var = environ.get("PATH", os.defpath)
    from_env = {"CC": _first_word(environ.get("CC", "")), "CXX": _first_word(environ.get("CXX", ""))}
    named_c = _which(from_env["CC"], path_var)
    named_cxx = _which(from_env["CXX"], path_var)
    c = named_c if from_env["CC"] else _which("gcc", path_var) or _which("clang", path_var)
    cxx = named_cxx if from_env["CXX"] else _which("c++", path_var)
    compilers = {p: "c" for p in [named_c, *(_which(n, path_var) for n in C_COMPILERS)] if p}
    compilers.update({p: "c++" for p in [named_cxx, *(_which(n, path_var) for n in CXX_COMPILERS)] if p})
    # A driver looks the assembler and linker up on PATH unless it was built to find its own.
    found: list[str] = [p for p in (_which(name, path_var) for name in ("as", "ld")) if p]
    asked: set[tuple[str, str]] = set()
    for compiler, language in compilers.items():
        found += link_chain(compiler)
        real = os.path.realpath(compiler)
        # A compiler the system installed under /usr runs and searches what it installed there;
        # one installed anywhere else is asked what it uses.
        if (real, language) not in asked and not any(_under(real, folder) for folder in shown):
            asked.add((real, language))
            found += _compiler_paths(compiler, language, environ)
    cuda_home = _cuda_home(environ, path_var)
    nvcc = _which("nvcc", path_var)
    for path in [cuda_home, nvcc, *_environment_paths(environ)]:
        if path:
            found += link_chain(path)
    paths = [os.path.normpath(p) for p in found if p and os.path.isabs(p) and os.path.exists(p)]
    paths = list(dict.fromkeys(paths))
    binds = _outermost([b for b in (_bind_for(p, list(shown)) for p in paths) if b])
    return Toolchain(c, cxx, cuda_home, tuple(paths), tuple(binds))


_ENVIRONMENT = ("PATH", "CC", "CXX", "CUDA_HOME", "CUDA_PATH", *PATH_VARS)


@functools.lru_cache(maxsize=8)
def _cached(key: tuple[tuple[str, str], ...], shown: tuple[str, ...]) -> Toolchain:
    return _resolve(dict(key), shown)


def find(environ: dict[str, str] | None = None, shown: tuple[str, ...] = ()) -> Toolchain:
    """The toolchain a child started with ``environ`` (default: the grader's) would use; folders
    under ``shown`` (what the sandbox binds anyway) need no bind. Asked once per environment."""
    environ = os.environ if environ is None else environ
    key = tuple((var, environ[var]) for var in _ENVIRONMENT if var in environ)
    return _cached(key, tuple(shown))


def check(*, gpu: bool) -> None:
    """Raise :class:`ToolMissing` where this machine lacks a tool every item of a profile needs."""
    problems = find().problems(gpu=gpu)
    if problems:
        raise ToolMissing("; ".join(problems))


if __name__ == "__main__":
    from autograder.engine import bwrap

    found = find(shown=bwrap.shown())
    print(f"C compiler: {found.c}\nC++ compiler: {found.cxx}\nCUDA toolkit: {found.cuda_home}")
    print("bound read-only in every sandbox:" if found.binds else "nothing to bind: all of it is under /usr")
    for path in found.binds:
        print(f"  {path}")
    sys.exit(1 if found.problems(gpu=True) else 0)
