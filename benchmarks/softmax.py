"""Benchmark of lab 02's softmax: five eager ops, torch.softmax, torch.compile and the Triton kernel.

Checks correctness first, then times every variant this machine can run (``softmax.BENCHMARK``)
and appends one row per measurement, with hardware columns, to ``benchmarks/results/softmax.csv``.
GB/s is the minimum traffic (the matrix read once, the result written once) over the time; on a
CPU the Triton rows need a GPU and are not written.

    python benchmarks/softmax.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import softmax

if __name__ == "__main__":
    run(softmax, __doc__)
