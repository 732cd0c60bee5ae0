"""Benchmark of lab 04 mixed precision: one AdamW step as a loop, as foreach ops, fused, and torch's three.

Checks correctness first, then times every variant this machine can run (``optim.BENCHMARK``) and
appends one row per measurement, with hardware columns, to ``benchmarks/results/optim.csv``. GB/s
are the minimum traffic of a step (``optim.adamw_bytes``) over the median time. On a CPU the
Triton rows need a GPU and are not written; the interpreter's time on a small list is recorded.

    python benchmarks/optim.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import optim

if __name__ == "__main__":
    run(optim, __doc__)
