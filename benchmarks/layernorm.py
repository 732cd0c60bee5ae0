"""Benchmark of lab 03 layernorm: the fused Triton kernels against F.layer_norm, forward and backward.

Checks correctness first, then times every variant this machine can run (``layernorm.BENCHMARK``)
and appends one row per measurement, with hardware columns, to ``benchmarks/results/layernorm.csv``.
GB/s are the minimum traffic (``layernorm.layer_norm_bytes``) over the median time. On a CPU the
Triton rows need a GPU and are not written; the interpreter's time on a small case, eager PyTorch
(fused and unfused) and torch.compile are recorded instead.

    python benchmarks/layernorm.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import layernorm

if __name__ == "__main__":
    run(layernorm, __doc__)
