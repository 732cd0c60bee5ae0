"""Take a student's Python classes and functions out of their cells, screened, and nothing else.

Some graded artefacts are Python, not kernels: a loss scaler, a training step, an optimizer
class. Run with the rest of their cells, such an artefact could lean on code the grade must not
rest on: a library object doing its work (``torch.amp.GradScaler`` behind a hand-written name),
or cell-level code that rebinds what the driver measures with. So the parent parses the cells
(never executing them) and keeps only

- top-level ``class`` and ``def`` statements, and literal constants (as ``kernels.py`` does);

and refuses the submission when anything kept could reach past the names the grader provides:

- ``import``, ``global`` and names or attributes with a double underscore (the ways out of a
  namespace: ``__class__``, ``__globals__``, ``__import__``, ``__builtins__``), except
  ``super().__init__`` and ``.__name__``;
- builtins that reach objects by name or run source (``getattr``, ``eval``, ``globals``, ...);
- attributes with a leading underscore except on ``self`` / ``cls`` / ``ctx`` (``torch._foreach_*``,
  ``torch._amp_update_scale_``, ``torch._C``: the library's private machinery);
- assigning or deleting attributes of anything but ``self`` / ``cls`` / ``ctx`` (``torch.Tensor.item = ...``,
  ``model.parameters = ...``: a rebound library method runs the student's code inside trusted
  code, after the instruments that count it have stopped), except assigning a gradient through a
  variable (``p.grad = None``, ``param.grad /= world_size``: what a gradient synchroniser or a
  sharded optimizer is for). The ``grad`` descriptors that assignment could replace on a class
  (``T = torch.Tensor; T.grad = ...``) are instruments of every such item (``GRAD_DESCRIPTORS``);
- attributes that lead to other modules (``sys``, ``modules``, ``importlib``, ``ops``) or start
  threads and processes (``threading``, ``multiprocessing``: work done there escapes the
  instruments of the calling thread), and those
  the item names as the library's own version of the graded technique (``Item.library``, a
  pattern: lab 04 refuses ``amp``, ``*Scaler*`` and ``*adam*``).

The child runs the kept code with a namespace built by the item's trusted ``scope`` and a
restricted set of builtins. The screen is a deny-list over a small language, not a proof: a name it
allows can still lead to a module that offers a way out. So every attribute the kept code reads is
rewritten into a call of the guard ``reach.py`` provides at run time, which refuses modules the item
does not provide, and the child refuses to unpickle what runs code. What neither can see, the
parent's checks of the values still judge.
"""

from __future__ import annotations

import ast
import functools
import re

from autograder.engine.kernels import JIT_NAMES, _constant, _dotted, top_level_statements
from autograder.engine.reach import DENIED_CALLS, GUARD
from fastdl_lab import pyast

DENIED_ATTRIBUTES = frozenset({
    "sys", "modules", "os", "importlib", "builtins", "ops", "library", "hub", "load",
    "f_globals", "f_locals", "f_back", "gi_frame", "cr_frame", "tb_frame", "func_globals",
    "threading", "multiprocessing", "subprocess", "ctypes", "Thread", "Process",
    # Readers that turn bytes into any object they name, and the loaders of native code.
    "pickle", "loads", "marshal", "read_pickle", "to_pickle", "load_pickle", "cpp_extension", "load_inline",
    "load_library", "tofile",
    # Object-passing collectives unpickle what another rank sends.
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
    "recv_object_list",
    # The interpreter's own view of every object and frame.
    "gc", "get_objects", "get_referrers", "get_referents", "inspect", "currentframe",
    # What frames, code and tracebacks are reached through (reach.py refuses such objects too).
    "ag_frame", "ag_code", "gi_code", "cr_code", "gi_yieldfrom", "cr_await", "ag_await", "tb_next", "f_code",
    "f_builtins", "f_trace", "cell_contents",
    # str.format reads any attribute a field names ("{0.__globals__}"): text leaks what it reads.
    "format", "format_map",
})
# An autograd.Function keeps its state on ``ctx`` as a class keeps it on ``self``. A name is only a
# name: a method can be handed a library class as its ``self`` or ``ctx``, so an item whose figures
# rest on library methods also names them as instruments (checked after the run).
OWN = frozenset({"self", "cls", "ctx"})
# Names only: a class's or function's name is a string, and error messages use it.
HARMLESS_DUNDERS = frozenset({"__name__", "__qualname__"})
# Checked unchanged after every extracted item's run (child.py's instruments): assigning ``.grad``
# through a variable that names a class would replace one of them for every tensor.
GRAD_DESCRIPTORS = ("torch.Tensor.grad", "torch.nn.Parameter.grad")



class ArtefactRejected(ValueError):
    """The cells define something the grader will not run; the message says what and where."""


def _reject(node: ast.AST, owner: str, what: str) -> None:
    raise ArtefactRejected(f"{owner}, line {getattr(node, 'lineno', '?')}: {what}")


# The language a graded class or function is written in: every node of its tree must be one of
# these. Python keeps adding syntax that reaches an object's attributes by name without an
# attribute node (a ``match`` statement's class patterns read any attribute they name, ``async``
# code hands out frames); a list of what is allowed does not grow with the language, a list of
# what is refused would.
ALLOWED_NODES = (
    # statements
    ast.FunctionDef, ast.ClassDef, ast.Return, ast.Delete, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For,
    ast.While, ast.If, ast.With, ast.Raise, ast.Try, ast.Assert, ast.Expr, ast.Pass, ast.Break, ast.Continue,
    ast.Nonlocal, ast.ExceptHandler, ast.withitem,
    # expressions
    ast.BoolOp, ast.NamedExpr, ast.BinOp, ast.UnaryOp, ast.Lambda, ast.IfExp, ast.Dict, ast.Set, ast.ListComp,
    ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Yield, ast.YieldFrom, ast.Compare, ast.Call,
    ast.FormattedValue, ast.JoinedStr, ast.Constant, ast.Attribute, ast.Subscript, ast.Starred, ast.Name,
    ast.List, ast.Tuple, ast.Slice, ast.comprehension, ast.arguments, ast.arg, ast.keyword,
    # what qualifies them
    ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop,
)


def _screen(tree: ast.stmt, library: re.Pattern | None) -> None:
    owner = f"{'class' if isinstance(tree, ast.ClassDef) else 'function'} {tree.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED_NODES):
            _reject(node, owner, f"{type(node).__name__} is not part of the Python graded code may use "
                                 "(no match statements, async code, imports or global)")
        if isinstance(node, ast.ClassDef) and node.keywords:
            _reject(node, owner, "a class may name its bases, nothing else (no metaclass)")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _reject(node, owner, "imports are not run by the grader: use the names the lab provides")
        elif isinstance(node, ast.Global):
            _reject(node, owner, "'global' is not allowed in a graded class or function")
        elif isinstance(node, ast.Name):
            if node.id.startswith("__"):
                _reject(node, owner, f"the name {node.id} is not allowed")
            if node.id in DENIED_CALLS:
                _reject(node, owner, f"{node.id}() is not available to graded code")
        elif isinstance(node, ast.Attribute):
            _screen_attribute(node, owner, library)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("__") \
                and not node.name.endswith("__"):
            _reject(node, owner, f"the name {node.name} is not allowed")


def _screen_attribute(node: ast.Attribute, owner: str, library: re.Pattern | None) -> None:
    attr = node.attr
    calls_super = (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                   and node.value.func.id == "super")
    if (attr == "__init__" and calls_super) or attr in HARMLESS_DUNDERS:
        return
    if attr.startswith("__"):
        _reject(node, owner, f"the attribute .{attr} is not allowed")
    on_own = isinstance(node.value, ast.Name) and node.value.id in OWN
    if attr == "grad" and isinstance(node.ctx, ast.Store) and isinstance(node.value, (ast.Name, ast.Subscript)):
        return
    if isinstance(node.ctx, (ast.Store, ast.Del)) and not on_own:
        _reject(node, owner, f"assigning .{attr}: graded code may change attributes of its own objects only (self.{attr})")
    if on_own:
        return
    if attr.startswith("_"):
        _reject(node, owner, f".{attr}: private attributes of other objects (the library's machinery) are not allowed")
    if attr in DENIED_ATTRIBUTES:
        _reject(node, owner, f".{attr}: graded code may not reach other modules, the interpreter or threads")
    if library is not None and library.search(attr):
        _reject(node, owner, f".{attr}: the graded technique must be your own code, not the library's")


def extract(sources: list[str], required: tuple[str, ...], library: str = "") -> str:
    """The artefact module of ``sources``: literal constants, screened classes and functions.
    ``library`` is a pattern (case-insensitive) of attribute names that lead to the library's
    version of what is graded.

    Raises ``ArtefactRejected`` when a cell does not parse, a kept definition fails the screen, or
    a name in ``required`` is not defined at the top level of the cells.
    """
    return _extracted(tuple(sources), tuple(required), library)


# The same cells are extracted for every child of an item (every rank of every world, in lab 07):
# the screen is a pure function of the sources, so each answer, or refusal, is kept.
@functools.lru_cache(maxsize=64)
def _extracted(sources: tuple[str, ...], required: tuple[str, ...], library: str) -> str:
    with pyast.LOCK:
        return _extract(list(sources), required, re.compile(library, re.IGNORECASE) if library else None)


def _extract(sources: list[str], required: tuple[str, ...], library: re.Pattern | None) -> str:
    kept: list[ast.stmt] = []
    defined: set[str] = set()
    for stmt in top_level_statements(sources, ArtefactRejected):
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) and not _is_jit(stmt):
            _screen(stmt, library)
            kept.append(stmt)
            defined.add(stmt.name)
        elif (const := _constant(stmt)) is not None:
            kept.append(const)
            # A required constant is an artefact too (lab 09's C++ source is a string).
            defined |= {n.id for t in const.targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])
                        if isinstance(n, ast.Name)} if isinstance(const, ast.Assign) else {const.target.id}
    missing = [name for name in required if name not in defined]
    if missing:
        raise ArtefactRejected(f"the solution cells define no class, function or constant named {missing[0]}")
    module = _GuardedReads().visit(ast.Module(body=kept, type_ignores=[]))
    return ast.unparse(ast.fix_missing_locations(module)) + "\n"


def string_constant(sources: list[str], name: str) -> str:
    """The string the cells bind to ``name`` at their top level (the last binding, as running them
    would leave it), read from their syntax alone: a source the grader builds rather than runs
    (lab 09's C++). Raises ``ArtefactRejected`` when a cell does not parse or no literal string is
    bound to ``name``."""
    with pyast.LOCK:
        found = None
        for stmt in top_level_statements(sources, ArtefactRejected):
            targets = (stmt.targets if isinstance(stmt, ast.Assign)
                       else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                value = stmt.value
                found = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
        if found is None:
            raise ArtefactRejected(f"the solution cells bind no string literal to {name} (the source must be written "
                                   "out in the cell, as r\"\"\"...\"\"\")")
        return found


class _GuardedReads(ast.NodeTransformer):
    """``a.b`` read becomes ``__fastdl_attr__(a, "b")``; stores and deletes stay as the screen let them."""

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        if not isinstance(node.ctx, ast.Load):
            return node
        return ast.copy_location(ast.Call(ast.Name(GUARD, ast.Load()), [node.value, ast.Constant(node.attr)], []), node)


def _is_jit(stmt: ast.stmt) -> bool:
    # Kernels are taken (and judged) by kernels.py; here they are neither kept nor screened.
    return isinstance(stmt, ast.FunctionDef) and any(
        _dotted(d.func if isinstance(d, ast.Call) else d) in JIT_NAMES for d in stmt.decorator_list)
