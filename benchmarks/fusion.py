"""Benchmark of lab 02 fusion: overhead, the repeated multiply, torch.compile, Conv+BN folding, ConvBN.

Checks correctness first, then runs every experiment of ``fusion.BENCHMARK`` and appends one row
per measurement, with hardware columns, to ``benchmarks/results/fusion.csv``: per-op overhead,
the repeated-multiply curve (eager and compiled), the compiled pointwise chain against eager, the
folded small CNN against the original (time and largest difference), and the bytes ConvBN saves
for backward with and without recomputation (peak memory too, on a GPU).

    python benchmarks/fusion.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import fusion

if __name__ == "__main__":
    run(fusion, __doc__)
