"""Benchmark of lab 04 amp: training steps of a small transformer block stack, fp32 against autocast.

Checks correctness first, then times every variant this machine can run (``amp.BENCHMARK``) and
appends one row per variant, with hardware columns, to ``benchmarks/results/amp.csv``: steps/s and
samples/s of forward + backward + AdamW, and the speedup over fp32 measured A/B interleaved. On a
CPU: fp32 and bf16 autocast; TF32 and fp16 with a GradScaler need a GPU and are not written.

    python benchmarks/amp.py [--reps 10] [--dry-run]
"""

from _runner import run

from fastdl_lab import amp

if __name__ == "__main__":
    run(amp, __doc__)
