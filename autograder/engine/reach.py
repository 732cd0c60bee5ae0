"""What extracted code can reach while it runs: the run-time half of the artefact screen.

``artefacts.py`` refuses source that names a way out, but a name it allows can still lead to one:
a public module of the library holds the unpickler, the package importer or the compiler of C++,
each of which runs or returns whatever its input names. So the child adds two checks before the
student's definitions exist:

- every attribute the extracted code reads goes through ``guarded_getattr`` (``artefacts.py``
  rewrites ``a.b`` into ``__fastdl_attr__(a, "b")``), which refuses to hand it a module that is
  neither imported by the item's scope nor in ``REACHABLE_MODULES``: ``torch.serialization``,
  ``torch.package``, ``torch.utils.cpp_extension`` or a lab helper's own imports stay out of reach;
- an audit hook refuses, for the whole run, to unpickle the builtins that run code or reach
  objects by name, anything from the modules that lead to the system, and any class or function
  whose name the item's ``library`` pattern matches: bytes received from another rank or read from
  a buffer cannot summon them.

Neither check can be switched off from extracted code: the hook cannot be removed, and the guard
lives in builtins the code cannot name.
"""

from __future__ import annotations

import builtins
import re
import sys
import types
from types import ModuleType

GUARD = "__fastdl_attr__"
SAFE_BUILTINS = {
    name: getattr(builtins, name) for name in (
        "abs", "all", "any", "bool", "callable", "dict", "divmod", "enumerate", "filter", "float", "hasattr",
        "frozenset", "id", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min",
        "next", "pow", "print", "range", "repr", "reversed", "round", "set", "slice", "sorted", "str",
        "sum", "super", "tuple", "zip", "object", "property", "staticmethod", "classmethod", "type",
        "NotImplemented", "Ellipsis", "Exception", "ArithmeticError", "AssertionError", "AttributeError",
        "IndexError", "KeyError", "LookupError", "NotImplementedError", "OverflowError", "RuntimeError",
        "StopIteration", "TypeError", "ValueError", "ZeroDivisionError", "__build_class__",
        # C code that imports while a student frame is the innermost one (torch's dispatch does)
        # looks __import__ up in that frame's builtins; the screen keeps the student's code from
        # naming it.
        "__import__",
    )
}

# The public parts of the libraries that graded classes and functions use, beyond the modules their
# item's scope imports.
REACHABLE_MODULES = frozenset({
    "math", "numpy", "numpy.linalg", "numpy.random",
    "torch", "torch.nn", "torch.nn.functional", "torch.nn.grad", "torch.nn.init", "torch.nn.utils", "torch.autograd",
    "torch.linalg", "torch.special", "torch.fft", "torch.random", "torch.cuda", "torch.cuda.nvtx", "torch.distributed",
    "torch.optim", "torch.utils", "torch.utils.data",
    "triton", "triton.language",
})
# Builtins that reach objects by name, run source or touch files: the screen refuses their names,
# and unpickling refuses them too (with __import__, which the screen refuses as a dunder).
DENIED_CALLS = frozenset({
    "getattr", "setattr", "delattr", "eval", "exec", "compile", "open", "globals", "locals",
    "vars", "dir", "breakpoint", "input", "help", "memoryview", "exit", "quit",
})
REFUSED_BUILTINS = DENIED_CALLS | {"__import__"}
REFUSED_MODULE_ROOTS = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "importlib", "ctypes", "runpy", "code", "codeop", "marshal", "pickle",
    "_pickle", "shutil", "socket", "pty", "signal", "io", "_io", "threading", "_thread", "gc", "inspect",
})


class Unreachable(PermissionError):
    """Extracted code asked for something outside what its item provides."""


# Objects that are the interpreter's own view of running code: from a frame, every caller's
# locals and globals are one step away.
INTERPRETER_TYPES = (types.FrameType, types.TracebackType, types.CodeType, types.CellType)
# Names read at run time that would read further by name (``str.format`` follows "{0.attr}").
REFUSED_NAMES = frozenset({"format", "format_map"})


def attribute_guard(scope_modules: frozenset[str]):
    """The getattr of extracted code: any attribute but the dunders and the readers by name, a
    module only if the item provides it, never a frame, code object, traceback or cell."""
    allowed = REACHABLE_MODULES | scope_modules

    def guarded_getattr(obj, name: str):
        if name in REFUSED_NAMES or (name.startswith("__") and name not in ("__name__", "__qualname__", "__init__")):
            raise Unreachable(f"graded code may not read .{name}")
        value = getattr(obj, name)
        if isinstance(value, ModuleType) and value.__name__ not in allowed:
            raise Unreachable(f"graded code may not reach the module {value.__name__}: use the names the lab provides")
        if isinstance(value, INTERPRETER_TYPES):
            raise Unreachable(f"graded code may not reach the interpreter's {type(value).__name__} objects")
        return value

    return guarded_getattr


def extracted_builtins(scope_modules: frozenset[str]) -> dict:
    """The builtins extracted code runs with: the safe ones and the attribute guard."""
    return {**SAFE_BUILTINS, GUARD: attribute_guard(scope_modules)}


def refuse_unpickling(library: str) -> None:
    """From now on, in this process, unpickling refuses what would run code or reach the system or
    the library's version of the graded technique (the item's ``library`` pattern)."""
    pattern = re.compile(library, re.IGNORECASE) if library else None

    def audit(event: str, args: tuple) -> None:
        if event != "pickle.find_class":
            return
        module, name = args
        parts = module.split(".")
        if (parts[0] in REFUSED_MODULE_ROOTS or (parts[0] in ("builtins", "__builtin__") and name in REFUSED_BUILTINS)
                or (pattern is not None and pattern.search(name))):
            raise Unreachable(f"unpickling {module}.{name} is refused while graded code runs")

    sys.addaudithook(audit)
