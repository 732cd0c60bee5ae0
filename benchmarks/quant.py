"""Benchmark of lab 09 quantisation: quantisation error, the int8 matmul, PTQ against QAT, fusion.

Checks correctness first (the Triton int8 kernel bit for bit against its reference), then records
per-tensor against per-channel error on trained layers, int8 against fp32 matrix products, float
/ PTQ / QAT accuracy over five seeds, and eager / BatchNorm-folded / torch.compile inference
(``quant.BENCHMARK``), one row per figure with hardware columns, in
``benchmarks/results/quant.csv``. On a CPU the Triton kernel is checked but not timed: under the
interpreter its time is Python's, so that row says "needs a GPU".

    python benchmarks/quant.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import quant

if __name__ == "__main__":
    run(quant, __doc__)
