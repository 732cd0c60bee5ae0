"""Take a student's Triton kernels out of their cells, and nothing else.

A kernel item grades ``@triton.jit`` functions, not the Python around them. The parent parses
the solution cells (it never executes them) and keeps only

- functions decorated ``@triton.jit`` (or ``@jit`` imported from triton), with constant keyword
  arguments to the decorator, constant defaults and annotations that are plain names
  (``tl.constexpr``): nothing in a kept definition runs code when it is defined;
- module-level constants: ``NAME = <literal>``, ``NAME: tl.constexpr = <literal>`` and
  ``NAME = tl.constexpr(<literal>)``.

The result is a module of its own, prefixed with the Triton imports, that the grading child
executes in place of the cells. Whether each kept body is a real kernel (calls nothing but
``tl.*`` and other jit functions) is proven by compiling it ahead of time (``child.py``).
"""

from __future__ import annotations

import ast

from fastdl_lab import pyast

HEADER = "import triton\nimport triton.language as tl\nfrom triton import jit\n"
JIT_NAMES = {"triton.jit", "jit"}


class KernelRejected(ValueError):
    """The cells define something the grader will not run as a kernel; the message says what."""


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_literal(node: ast.AST | None) -> bool:
    if node is None:
        return True
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return isinstance(node.operand, ast.Constant)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_literal(k) and _is_literal(v) for k, v in zip(node.keys, node.values))
    return False


def _check_decorator(fn: ast.FunctionDef) -> bool:
    """True for a jit function; raises for a jit function with anything else around it."""
    names = []
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.append(_dotted(target))
    if not any(name in JIT_NAMES for name in names):
        return False
    if len(fn.decorator_list) != 1:
        raise KernelRejected(f"{fn.name}: only @triton.jit may decorate a kernel (found {len(names)} decorators)")
    dec = fn.decorator_list[0]
    if isinstance(dec, ast.Call) and (dec.args or not all(_is_literal(k.value) for k in dec.keywords)):
        raise KernelRejected(f"{fn.name}: @triton.jit(...) may only take constant keyword arguments")
    return True


def _check_signature(fn: ast.FunctionDef) -> None:
    args = fn.args
    for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
        if not _is_literal(default):
            raise KernelRejected(f"{fn.name}: default values of a kernel's arguments must be constants")
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    for arg in every:
        if arg.annotation is not None and _dotted(arg.annotation) is None:
            raise KernelRejected(f"{fn.name}: the annotation of {arg.arg} must be a name such as tl.constexpr")
    if fn.returns is not None and _dotted(fn.returns) is None:
        raise KernelRejected(f"{fn.name}: the return annotation must be a name")


def _constant(stmt: ast.stmt) -> ast.stmt | None:
    """A module-level constant worth keeping, or None for anything else (which is dropped)."""
    if isinstance(stmt, ast.Assign):
        targets, value = stmt.targets, stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        if _dotted(stmt.annotation) is None:
            return None
        targets, value = [stmt.target], stmt.value
    else:
        return None
    # Dunder names (__builtins__ above all) would change how the kept functions resolve names.
    names = [n for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])]
    if not all(isinstance(n, ast.Name) and not n.id.startswith("__") for n in names):
        return None
    if isinstance(value, ast.Call):
        wraps_literal = (_dotted(value.func) in ("tl.constexpr", "triton.language.constexpr")
                         and len(value.args) == 1 and not value.keywords and _is_literal(value.args[0]))
        return stmt if wraps_literal else None
    return stmt if _is_literal(value) else None


def extract(sources: list[str], required: tuple[str, ...]) -> str:
    """The kernel module of ``sources``: Triton imports, constants, jit functions.

    Raises ``KernelRejected`` when a cell does not parse, a jit function carries code that would
    run at definition time, or a kernel in ``required`` is not among the jit functions.
    """
    # Items are graded on two threads; extraction holds the process's one parse lock (fastdl_lab/pyast.py).
    with pyast.LOCK:
        return _extract(sources, required)


def top_level_statements(sources: list[str], rejected: type[ValueError]):
    """Every top-level statement of the cells, in order; a cell that does not parse raises ``rejected``."""
    for i, source in enumerate(sources):
        try:
            tree = pyast.parse(source)
        except SyntaxError as exc:
            raise rejected(f"solution cell {i + 1} does not parse: line {exc.lineno}: {exc.msg}") from exc
        yield from tree.body


def _extract(sources: list[str], required: tuple[str, ...]) -> str:
    kept: list[ast.stmt] = []
    kernels: set[str] = set()
    for stmt in top_level_statements(sources, KernelRejected):
        if isinstance(stmt, ast.FunctionDef) and _check_decorator(stmt):
            _check_signature(stmt)
            kept.append(stmt)
            kernels.add(stmt.name)
        elif (const := _constant(stmt)) is not None:
            kept.append(const)
    missing = [name for name in required if name not in kernels]
    if missing:
        raise KernelRejected(f"the solution cells define no @triton.jit function named {missing[0]}")
    # A scaffolded kernel with one part still the release's stub would otherwise fail to compile
    # and be called "not a Triton kernel".
    for fn in kept:
        if isinstance(fn, ast.FunctionDef) and fn.name in required and pyast.raises_not_implemented(fn):
            raise KernelRejected(f"{fn.name} is not finished: it still raises NotImplementedError where the "
                                 "release left '# YOUR CODE HERE'")
    module = ast.Module(body=kept, type_ignores=[])
    return HEADER + ast.unparse(ast.fix_missing_locations(module)) + "\n"
