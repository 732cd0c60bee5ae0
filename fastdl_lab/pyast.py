"""One lock for Python's syntax trees in this process.

On CPython 3.11, turning source into a syntax tree (``ast.parse``) in two threads at once can
fail with ``SystemError: AST constructor recursion depth mismatch``: the converter's depth counter
is shared by the whole interpreter (CPython issue gh-106905). The grader parses students' cells
while other items of the same submission build their inputs (lab 06 parses the standard library
for real text lengths), so every parse in a process that grades goes through ``parse`` here.
"""

from __future__ import annotations

import ast
import threading

LOCK = threading.RLock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    with LOCK:
        return ast.parse(source, filename=filename)


def raises_not_implemented(tree: ast.AST) -> bool:
    """True if ``tree`` holds ``raise NotImplementedError``: the stub nbgrader leaves where a solution goes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id == "NotImplementedError":
                return True
    return False
