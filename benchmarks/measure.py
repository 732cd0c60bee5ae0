"""Benchmark of lab 00 measure: the measured roofline, and a vector add and matmuls placed on it.

Checks the lab's calculators first, then appends one row per measurement, with hardware columns,
to ``benchmarks/results/measure.csv``. The launch-only rows (the missing-synchronize error on a
real GPU) need a GPU and are not written on a CPU.

    python benchmarks/measure.py [--dry-run]
"""

from _runner import run

from fastdl_lab import measure

if __name__ == "__main__":
    run(measure, __doc__)
