"""benchmarks/grading.py's reading of an executed notebook: where nbgrader's run spends its time."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "grading.py"


def _grading():
    spec = importlib.util.spec_from_file_location("grading_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(source, started=None, replied=None):
    stamps = {} if started is None else {"iopub.execute_input": started, "shell.execute_reply": replied}
    return {"cell_type": "code", "source": source, "metadata": {"execution": stamps}, "outputs": []}


def test_slowest_cells_are_the_longest_timed_code_cells_first():
    executed = {"cells": [
        _cell("import torch", "2026-11-27T08:00:00.000000Z", "2026-11-27T08:00:00.500000Z"),
        _cell(["x = 1\n", "compiled = torch.compile(f)"], "2026-11-27T08:00:01.000000Z", "2026-11-27T08:00:05.250000Z"),
        _cell("untimed = True"),  # a test cell nbgrader's run left unexecuted
        {"cell_type": "markdown", "source": "# prose", "metadata": {}},
        _cell("y = 2", "2026-11-27T08:00:06.000000Z", "2026-11-27T08:00:06.100000Z"),
    ]}
    rows = _grading().slowest_cells(executed, 2)
    assert [(round(s, 3), i) for s, i, _ in rows] == [(4.25, 1), (0.5, 0)]
    assert rows[0][2] == "x = 1 | compiled = torch.compile(f)"
