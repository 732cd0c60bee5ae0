"""The labs' ungraded experiments as a benchmark: whole rows, GPU rows that say so, a committed table."""

import csv
from pathlib import Path

import pytest

from fastdl_lab import device, experiments

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "experiments.csv"


def test_a_row_has_every_column_and_refuses_others():
    r = experiments.row(lab="01", figure=3.0)
    assert list(r) == experiments.BENCHMARK["columns"] and r["figure"] == 3.0 and r["note"] is None
    with pytest.raises(KeyError, match="speed"):
        experiments.row(speed=1.0)


@pytest.mark.skipif(device.has_gpu(), reason="the rows a CPU host keeps without a figure")
def test_quick_run_measures_what_the_cpu_can_and_names_the_rest():
    rows = experiments.benchmark(log=lambda _: None, size="quick")
    measured = [r for r in rows if r["note"] is None or not r["note"].startswith(experiments.NEEDS_GPU)]
    waiting = [r for r in rows if r not in measured]
    assert {r["lab"] for r in measured} == {"01", "02", "04", "06", "09"}
    assert all(r["median_s"] is None and r["figure"] is None for r in waiting)
    assert {r["experiment"] for r in waiting} >= {"host-to-device copy", "overhead-bound loop", "caching allocator"}
    # A float learning rate recompiles once the schedule changes it; a tensor one does not.
    graphs = {r["variant"]: r["figure"] for r in rows if r["experiment"] == "compiled optimizer step"}
    assert graphs == {"AdamW, LinearLR, lr as a float": 2, "AdamW, LinearLR, lr as a 0-d tensor": 1}
    accuracy = {r["variant"]: r["figure"] for r in rows if r["unit"] == "test accuracy"}
    assert accuracy["distilled"] > accuracy["hard labels"]


def test_the_committed_table_has_a_cpu_row_for_every_experiment():
    with RESULTS.open(newline="") as f:
        rows = list(csv.DictReader(f))
    cpu = {(r["lab"], r["experiment"]) for r in rows if r["device_kind"] == "cpu"}
    assert {("01", "conv as a matmul"), ("01", "K alignment"), ("02", "FLOPs against time"),
            ("04", "memory pool (CPU malloc)"),
            ("04", "compiled optimizer step"), ("06", "latency ladder"), ("09", "distillation"),
            ("09", "depthwise-separable conv"), ("09", "sparse product")} <= cpu
