"""nbgrader's run of a submission skips the test cells, which the trusted engine grades itself."""

import ast

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from nbgrader.preprocessors import Execute, SaveAutoGrades
from nbgrader.utils import determine_grade

from autograder.course import lab_sources, to_nbgrader_notebook
from autograder.engine.items import all_labs
from autograder.execute import AS_RELEASED, NOT_RUN, ExecuteUngradedCells, SaveGradesOfOtherCells, autograde_preprocessors
from autograder.feedback import is_test_cell
from autograder.formgrader import TrustedAutograde


def graded(source, grade_id, **meta):
    return new_code_cell(source, metadata={"nbgrader": {"grade_id": grade_id, "points": 2, **meta}})


def test_test_cells_are_left_a_note_and_every_other_cell_runs(tmp_path):
    nb = new_notebook(cells=[
        graded("def f():\n    return 41", "f_code", solution=True, grade=False),
        graded("assert f() == 42", "f_test", solution=False, grade=True),
        new_code_cell("print(f() + 1)"),
    ])
    ExecuteUngradedCells(kernel_name="python3", timeout=60).preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    solution, test, after = nb.cells
    assert test.outputs == [nbformat.v4.new_output("stream", name="stderr", text=NOT_RUN)]
    assert test.execution_count is None
    # Until the engine's verdict is written, nbgrader counts the unrun item as nothing.
    assert determine_grade(test) == (0, 2)
    assert after.outputs[0]["text"] == "42\n" and solution.execution_count == 1


def test_a_notebook_as_released_runs_nothing_and_says_why(tmp_path):
    from autograder.jobs import _code_as_released

    cells = [graded("def f():\n    raise NotImplementedError", "f_code", solution=True, grade=False),
             new_code_cell("print(open('/etc/hostname').read())")]
    release = tmp_path / "release.ipynb"
    nbformat.write(new_notebook(cells=cells), release)
    submitted = nbformat.reads(nbformat.writes(new_notebook(cells=cells)), as_version=4)
    as_dict = nbformat.from_dict(submitted)
    assert _code_as_released(as_dict, release)
    # The same code as a list of lines (nbformat's other spelling) is the same code.
    lines = {**as_dict, "cells": [{**c, "source": c["source"].splitlines(keepends=True)} for c in as_dict["cells"]]}
    assert _code_as_released(lines, release)
    changed = nbformat.from_dict(submitted)
    changed.cells[0].source = "def f():\n    return 42"
    assert not _code_as_released(changed, release)
    assert not _code_as_released(as_dict, tmp_path / "missing.ipynb")
    ExecuteUngradedCells(kernel_name="python3", timeout=60, as_released=True).preprocess(
        submitted, {"metadata": {"path": str(tmp_path)}})
    assert submitted.cells[0].outputs == [nbformat.v4.new_output("stream", name="stderr", text=AS_RELEASED)]
    assert submitted.cells[1].outputs == [] and submitted.cells[1].execution_count is None


def test_only_nbgraders_execute_and_save_steps_are_replaced():
    steps = autograde_preprocessors()
    assert ExecuteUngradedCells in steps and Execute not in steps and SaveAutoGrades not in steps
    assert [s.__name__ for s in steps if s is not ExecuteUngradedCells] == [
        "IgnorePattern", "ClearMetadataPreprocessor", "LimitOutput", "SaveGradesOfOtherCells", "AssignLatePenalties",
        "CheckCellMetadata"]
    # In the course folder, nbgrader's autograde is the trusted pipeline and saves nothing of its own.
    course_steps = autograde_preprocessors(execute=TrustedAutograde, save=None)
    assert course_steps[0] is TrustedAutograde and not {Execute, SaveAutoGrades, SaveGradesOfOtherCells} & set(course_steps)


def test_a_test_cells_output_never_becomes_its_score(monkeypatch):
    """A test cell whose result is a float would be partial credit for nbgrader; its grade is left alone."""
    touched = []
    monkeypatch.setattr(SaveAutoGrades, "_add_score", lambda self, cell, resources: touched.append(cell))
    monkeypatch.setattr(SaveAutoGrades, "_add_comment", lambda self, cell, resources: None)
    float_tail = graded("f()\n0.5", "f_test", solution=False, grade=True)
    float_tail.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "0.5"}, execution_count=1)]
    assert determine_grade(float_tail) == (0.5, 2)  # what nbgrader alone would have written: partial credit
    manual = graded("", "essay", solution=True, grade=True)
    save = SaveGradesOfOtherCells()
    save.preprocess_cell(float_tail, {}, 0)
    assert touched == []
    save.preprocess_cell(manual, {}, 1)
    assert touched == [manual]


@pytest.fixture(scope="module")
def notebooks():
    return {lab: to_nbgrader_notebook(path) for lab, path in lab_sources().items()}


def test_every_test_cell_is_an_engine_item(notebooks):
    specs = all_labs()
    for lab, nb in notebooks.items():
        tests = sorted(c.metadata["nbgrader"]["grade_id"] for c in nb.cells if is_test_cell(c))
        assert tests == sorted(item.name for item in specs[lab].items), lab


def _bound(tree):
    """Every name the cell binds, in any scope (functions' parameters and locals too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def test_no_later_cell_needs_a_name_only_a_test_cell_defines(notebooks):
    """With the test cells left unrun, such a name would be undefined in the grader's run."""
    for lab, nb in notebooks.items():
        from_tests, elsewhere = {}, set()
        for cell in (c for c in nb.cells if c.cell_type == "code"):
            tree = ast.parse("\n".join(ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!"))))
            bound = _bound(tree)
            if is_test_cell(cell):
                from_tests.update(dict.fromkeys(bound - elsewhere, cell.metadata["nbgrader"]["grade_id"]))
                continue
            loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            needed = {name: from_tests[name] for name in loaded - bound - elsewhere if name in from_tests}
            assert not needed, f"{lab}: a cell uses names only test cells define: {needed}"
            elsewhere |= bound
