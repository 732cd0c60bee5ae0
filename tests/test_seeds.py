"""Hidden inputs per attempt: a regrade of the same submission under the recorded seed is identical,
while a changed solution (a new attempt) gets inputs of its own, whatever the batch seed; a child's
text never carries long numbers back into a reason."""

from __future__ import annotations

import json

from autograder.engine import grade


def _notebook(path, solution: str, output: str = "") -> str:
    cell = {"cell_type": "code", "source": solution, "execution_count": None, "outputs": [],
            "metadata": {"nbgrader": {"grade_id": "code", "solution": True}}}
    if output:
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": output}]
    test = {"cell_type": "code", "source": "assert True", "execution_count": None, "outputs": [],
            "metadata": {"nbgrader": {"grade_id": "test", "grade": True, "points": 1}}}
    path.write_text(json.dumps({"cells": [cell, test], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return grade.attempt_digest(path)


def test_an_attempt_is_its_solution_cells(tmp_path):
    first = _notebook(tmp_path / "a.ipynb", "def f(x):\n    return x\n")
    saved_again = _notebook(tmp_path / "b.ipynb", "def f(x):\n    return x\n", output="ran once more")
    changed = _notebook(tmp_path / "c.ipynb", "def f(x):\n    return x + 0\n")
    assert first and first == saved_again and first != changed
    assert grade.attempt_digest(tmp_path / "missing.ipynb") == ""


def test_each_attempt_draws_its_own_inputs_under_one_batch_seed():
    seed = 1234
    one = grade.student_seed(seed, "01_gemm", "ada", "aaaa")
    assert one == grade.student_seed(seed, "01_gemm", "ada", "aaaa")  # a regrade is identical
    assert one != grade.student_seed(seed, "01_gemm", "ada", "bbbb")  # a resubmission is not
    assert one != grade.student_seed(seed, "01_gemm", "bob", "aaaa")
    assert grade.item_seed(one, "matmul_fp32") != grade.item_seed(grade.student_seed(seed, "01_gemm", "ada", "bbbb"),
                                                                  "matmul_fp32")


def test_long_numbers_a_child_wrote_are_redacted():
    text = "ValueError: got tensor([0.12345, -1.75, 3.0]) with seed 987654321 at shape (128, 130)"
    assert grade.redact_numbers(text) == "ValueError: got tensor([#, -1.75, 3.0]) with seed # at shape (128, 130)"
