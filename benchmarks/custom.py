"""Benchmark of lab 09 custom ops: the LLTM cell in Python, C++ and (on a GPU host) CUDA C++.

Checks correctness first, builds the C++ extension cold (the build time is a row), compiles the
CUDA source to PTX for sm_80 and sm_90 (timed too), checks every backend against the reference,
then times forward and backward at batch 16, 32 input features, 128 state (``custom.BENCHMARK``)
against the hand-written Python ops. Rows are appended, with hardware columns, to
``benchmarks/results/custom.csv``. Without a GPU the CUDA rows need a GPU and are not written.

    python benchmarks/custom.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import custom

if __name__ == "__main__":
    run(custom, __doc__)
