"""Benchmark of lab 05 attention: the Triton FlashAttention kernels against naive attention and
F.scaled_dot_product_attention, forward and forward + backward.

Checks correctness first, then measures what this machine can (``attention.BENCHMARK``) and
appends one row per measurement, with hardware columns, to ``benchmarks/results/attention.csv``.
On a GPU: TFLOP/s (``attention.attention_flops`` over the median time) across sequence lengths.
On a CPU the speed rows need a GPU and are not written; the bytes autograd saves for the backward
(naive quadratic, flash linear in N) and the interpreter's time on a small case are recorded.

    python benchmarks/attention.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import attention

if __name__ == "__main__":
    run(attention, __doc__)
