import json

import pytest

from autograder import notebook


def nb(*cells):
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def code(grade_id, source, *, solution=False, grade=False):
    meta = {"nbgrader": {"grade_id": grade_id, "solution": solution, "grade": grade}}
    return {"cell_type": "code", "metadata": meta, "source": source, "outputs": [], "execution_count": None}


RELEASE = nb(
    code("f_code", "def f():\n    # YOUR CODE HERE\n    raise NotImplementedError()", solution=True),
    code("f_test", "assert f() == 1", grade=True),
)


def test_graded_cells_by_id():
    cells = notebook.graded_cells(RELEASE)
    assert list(cells.solutions) == ["f_code"] and list(cells.tests) == ["f_test"]


@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ('{"cells": 3}', "no list of cells"),
    ("[]", "no list of cells"),
])
def test_unreadable_notebooks_are_named(tmp_path, text, words):
    path = tmp_path / "x.ipynb"
    path.write_text(text)
    with pytest.raises(notebook.NotebookError, match=words):
        notebook.read_notebook(path)


def test_tampering_and_unanswered():
    released = notebook.graded_cells(RELEASE)
    answered = notebook.graded_cells(nb(code("f_code", "def f():\n    return 1", solution=True),
                                        code("f_test", "assert f() == 1  ", grade=True)))
    assert notebook.test_cell_problem("f_test", answered, released) is None  # trailing spaces are fine
    assert notebook.solution_problem(("f_code",), answered, released) is None
    assert "as released" in notebook.solution_problem(("f_code",), released, released)
    edited = notebook.graded_cells(nb(code("f_test", "pass", grade=True)))
    assert "edited" in notebook.test_cell_problem("f_test", edited, released)
    assert "missing" in notebook.solution_problem(("f_code",), edited, released)
    assert "deleted" in notebook.test_cell_problem("f_test", notebook.graded_cells(nb()), released)


def test_list_sources_are_joined(tmp_path):
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb(code("f_test", ["assert f() ", "== 1"], grade=True))))
    assert notebook.graded_cells(notebook.read_notebook(path)).tests["f_test"] == "assert f() == 1"
