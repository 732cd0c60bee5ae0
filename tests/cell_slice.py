"""The cells of a notebook that its test cells depend on, found from the names each cell binds and
reads: what ``test_labs_execute`` runs at the quick sizes.

The other cells are the ungraded experiments. The demo class's nbgrader run of every lab's
reference executes them (``test_reference_notebook_records_are_clean``), so running them here too
would only repeat that work.

The slice is conservative where it can be, and exact where it must be:

- a cell is kept if it binds, or changes in place (``x[i] = ...``, ``x.a = ...``, ``x += ...``),
  a name that a kept later cell reads, anywhere in its code (functions read globals when called);
- every earlier cell that binds such a name is kept, not just the latest, so that a name built up
  over several cells is built up the same way;
- a cell that cannot be parsed as Python (a magic) is kept;
- what no name shows (a cell that only seeds the global random generator, say) is not seen: a
  test cell that depended on it would fail here, every time, not now and then.
"""

from __future__ import annotations

import ast
import symtable

from autograder.feedback import is_test_cell


class _TopLevel(ast.NodeVisitor):
    """The cell's top level in the order Python runs it: what it binds, and what it reads before
    binding it (a loop variable or a temporary of the cell is not read from an earlier cell)."""

    def __init__(self):
        self.binds: set[str] = set()
        self.reads: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.binds:
                self.reads.add(node.id)
        else:
            self.binds.add(node.id)

    def _nested(self, node) -> None:
        # The body runs later, or in a scope of its own (symtable finds what it reads); its
        # decorators, defaults and first iterable run here.
        for child in (*getattr(node, "decorator_list", ()), *getattr(node, "bases", ())):
            self.visit(child)
        arguments = getattr(node, "args", None)
        if isinstance(arguments, ast.arguments):
            for default in (*arguments.defaults, *filter(None, arguments.kw_defaults)):
                self.visit(default)
        if getattr(node, "generators", None):
            self.visit(node.generators[0].iter)
        if hasattr(node, "name"):
            self.binds.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _nested
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _nested

    def visit_Import(self, node) -> None:
        self.binds.update((alias.asname or alias.name).split(".")[0] for alias in node.names)

    visit_ImportFrom = visit_Import

    def _target(self, target) -> None:
        if isinstance(target, ast.Name):
            self.binds.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._target(element)
        elif isinstance(target, ast.Starred):
            self._target(target.value)
        else:
            # x[i] = ..., x.a = ...: reads x (and i), and changes in place the object x names.
            self.visit(target)
            while isinstance(target, (ast.Subscript, ast.Attribute)):
                target = target.value
            if isinstance(target, ast.Name):
                self.binds.add(target.id)

    def visit_Assign(self, node) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._target(target)

    def visit_AugAssign(self, node) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name) and node.target.id not in self.binds:
            self.reads.add(node.target.id)
        self._target(node.target)

    def visit_AnnAssign(self, node) -> None:
        if node.value is not None:
            self.visit(node.value)
        self._target(node.target)

    def visit_NamedExpr(self, node) -> None:
        self.visit(node.value)
        self.binds.add(node.target.id)

    def visit_For(self, node) -> None:
        self.visit(node.iter)
        self._target(node.target)
        for statement in (*node.body, *node.orelse):
            self.visit(statement)

    visit_AsyncFor = visit_For

    def visit_ExceptHandler(self, node) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.binds.add(node.name)
        for statement in node.body:
            self.visit(statement)


def _globals_read_in(table: symtable.SymbolTable) -> set[str]:
    """Module names that the functions, classes and comprehensions under ``table`` read."""
    found = set()
    for child in table.get_children():
        found |= {s.get_name() for s in child.get_symbols() if s.is_global() and s.is_referenced()}
        found |= _globals_read_in(child)
    return found


def names(source: str) -> tuple[set[str], set[str]] | None:
    """(binds, reads) of one cell's source, or None if it is not plain Python."""
    try:
        tree = ast.parse(source)
        table = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return None
    top = _TopLevel()
    top.visit(tree)
    # What a function of this cell reads from a name the cell binds is the cell's own.
    return top.binds, top.reads | (_globals_read_in(table) - top.binds)


def needed_cells(nb) -> list[int]:
    """Indices of the code cells to run, in order: every test cell and what it depends on."""
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    wanted: set[str] = set()
    kept: list[int] = []
    for i in reversed(code):
        cell = nb.cells[i]
        found = names(cell.source)
        if found is None or is_test_cell(cell) or found[0] & wanted:
            kept.append(i)
            if found is not None:
                wanted |= found[1]
    return sorted(kept)
