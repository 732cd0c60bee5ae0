"""Failures of the grading machine, told apart from failures of the student's code.

A child can fail because the machine cannot run what its item needs: no compiler where Triton
builds its launcher or lab 09 builds C++, no GPU driver or CUDA library, a sandbox that bubblewrap
or the fork server could not make. Graded as the student's error, such a failure costs every
student the item (the reference too) with a reason that blames their code. Here it is an item
``not_graded``, with the machine's reason.

A ``not_graded`` item scores 0 and is counted, as a job the grader lost is (``batch.py``): a Python
item's code can raise any exception it likes, so claiming a fault of the machine must gain a
submission nothing. What it does is make noise: the run's summary names every such item first
(``progress.summary_lines``), and ``make gpu-class`` fails on any.

The child calls :func:`child_status` on the exception that ended its run (``child.py``); the
parent calls :func:`machine_fault` on what came back (``grade.py``). This module imports nothing
but the standard library: the child imports it inside the sandbox before any student code exists.
"""

from __future__ import annotations

import os
import re

NOT_GRADED = "not_graded"
# The status a child writes in its error report for a fault of the machine.
MACHINE = "machine"
PREFIX = "not graded, a fault of the grading machine (not of the submission): "

# Programs a build runs: compiler drivers (also as x86_64-linux-gnu-gcc-13, gcc-12), the compiler
# proper, assembler, linker, CUDA's compilers, the build tool torch's extensions use.
_TOOL = re.compile(r"^(?:[\w.]+-)*(cc|gcc|g\+\+|c\+\+|clang|clang\+\+|cc1|cc1plus|collect2|as|ld|ld\.\w+|nvcc|ptxas|"
                   r"ninja)(?:-[\d.]+)?$")
# Short names that are also English words count only as a path ("/opt/binutils/bin/as").
_WORDS = frozenset({"as", "cc", "ld"})
# What a build or the loader says when the machine lacks a piece: a shared library the sandbox
# does not show (or a machine without the CUDA runtime), a compiler driver without its compiler
# proper or assembler, torch's extensions without ninja.
_MISSING = re.compile("|".join([
    r"lib[\w+.-]*\.so[\d.]*: cannot open shared object file", r"cannot execute '[^']+': execvp",
    r"error trying to exec '[^']+': execvp", r"installation problem, cannot exec",
    r"Ninja is required to load C\+\+ extensions",
]))
# What torch and the CUDA runtime say where there is no usable GPU or driver. Only a child meant
# to use the GPU can meet them through the machine: on a CPU profile the grader hides every GPU,
# and a submission that asks for one there made the mistake itself.
_NO_GPU = re.compile("|".join([
    r"no CUDA-capable device is detected", r"CUDA driver version is insufficient", r"Found no NVIDIA driver",
    r"CUDA driver initialization failed", r"Torch not compiled with CUDA enabled",
    r"CUDA-capable device\(s\) is/are busy or unavailable", r"no kernel image is available for execution",
    r"unsupported display driver / cuda driver combination", r"forward compatibility was attempted",
    r"\d+ active drivers", r"libcuda\.so cannot found", r"Failed to find C compiler",
]))
# Functions of Triton that build or locate what every launch needs; an exception raised under
# them is the machine's (the kernel's own failures come from compiling it, or from the launch).
_TRITON_BUILD = re.compile(r"triton/runtime/build\.py$")
_TRITON_SETUP = frozenset({"libcuda_dirs", "library_dirs"})
# Where a sandbox that never started says so: bubblewrap's own messages, the fork server's.
_SANDBOX = ("bwrap: ", "sandbox setup failed (")


class MachineLacks(RuntimeError):
    """Raised by an item's trusted code where this machine lacks what the item needs (RAPIDS for
    lab 08's GPU items): the item is not graded, and the message says what is missing."""


def _tool_named(text: str | None, *, in_prose: bool = False) -> str | None:
    """``text`` where it names a build tool; in prose, "as", "cc" and "ld" count only as paths."""
    word = str(text or "").strip("'\"()[],:; ")
    name = os.path.basename(word)
    if not _TOOL.match(name) or (in_prose and name in _WORDS and "/" not in word):
        return None
    return word


def _missing_tool(exc: BaseException) -> str | None:
    """The tool an OSError says could not be run: its file name, or a tool named in its message
    ("no nvcc on PATH")."""
    if not isinstance(exc, OSError):
        return None
    named = _tool_named(exc.filename) if isinstance(exc.filename, str) else None
    return named or next((w for w in (_tool_named(word, in_prose=True) for word in str(exc).split()) if w), None)


def _chain(exc: BaseException) -> list[BaseException]:
    found, seen = [], set()
    while exc is not None and id(exc) not in seen and len(found) < 20:
        seen.add(id(exc))
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def _under_triton_setup(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if _TRITON_BUILD.search(code.co_filename.replace(os.sep, "/")) or (
                code.co_name in _TRITON_SETUP and "/triton/" in code.co_filename.replace(os.sep, "/")):
            return True
        tb = tb.tb_next
    return False


def exception_fault(exc: BaseException, *, gpu: bool) -> str | None:
    """Why ``exc`` is the machine's fault (one line), or None where it may be the code's. ``gpu``:
    the child was meant to use the GPU."""
    for link in _chain(exc):
        text = f"{type(link).__name__}: {link}"
        if isinstance(link, MachineLacks):
            return f"this machine lacks what the item needs: {link}"
        tool = _missing_tool(link)
        if tool:
            return f"a build tool could not be run in the sandbox ({tool}): {text}"
        if _MISSING.search(str(link)):
            return f"a build tool or library is missing in the sandbox: {text}"
        if _under_triton_setup(link):
            return f"Triton could not build or load its launcher: {text}"
        if gpu and _NO_GPU.search(str(link)):
            return f"the GPU or its driver is not usable: {text}"
    return None


def child_status(exc: BaseException) -> str:
    """The status a child reports for the exception that ended its run: ``MACHINE`` or ``error``."""
    gpu = os.environ.get("TRITON_INTERPRET") != "1"
    return MACHINE if exception_fault(exc, gpu=gpu) else "error"


def machine_fault(reported: tuple[str, str] | None, output_tail: str) -> str | None:
    """The reason an item is not graded, from what its child ``reported`` (status, message) or,
    where it reported nothing, from its output: a sandbox that could not start, or an interpreter
    that could not load a library before the child's code began."""
    if reported is not None:
        status, message = reported
        return PREFIX + message if status == MACHINE else None
    head = output_tail.lstrip()
    if head.startswith(_SANDBOX):
        return PREFIX + "the sandbox could not start: " + head.splitlines()[0]
    last = (output_tail.strip().splitlines() or [""])[-1]
    if _MISSING.search(last):
        return PREFIX + last
    return None
