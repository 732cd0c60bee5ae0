"""Benchmark of lab 01 gemm: Python loops, NumPy, torch.matmul, TF32 and the Triton kernel.

Checks correctness first, then times every variant this machine can run (``gemm.BENCHMARK``)
and appends one row per measurement, with hardware columns, to ``benchmarks/results/gemm.csv``.
On a CPU the Triton and TF32 rows need a GPU and are not written.

    python benchmarks/gemm.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import gemm

if __name__ == "__main__":
    run(gemm, __doc__)
