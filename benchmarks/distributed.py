"""Benchmark of lab 07 distributed: data-parallel step times, collective bytes and times, ZeRO-1 state.

Checks every module on small worlds first, then measures what ``distributed.BENCHMARK`` lists and
appends one row per measurement, with hardware columns, to ``benchmarks/results/distributed.csv``:
a DDP step on 1 and 2 gloo ranks (naive, per-parameter and bucketed, with all-reduce calls per
step), the ring all-reduce from send/recv against gloo's own (bytes sent per rank, time), and the
optimizer state per rank of Adam sharded by Zero1 over 1, 2 and 4 ranks, and FSDP's bytes per rank
(parameters, gradients, momentum, the most gathered at once) and collectives per step. NCCL rows need a GPU per rank and are skipped otherwise.

    python benchmarks/distributed.py [--reps 10] [--dry-run]
"""

import os

# Before torch is imported: check for GPUs through NVML, so that the parent never initialises the
# CUDA driver and forked NCCL ranks can still use their GPUs.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from _runner import run  # noqa: E402

from fastdl_lab import distributed  # noqa: E402

if __name__ == "__main__":
    run(distributed, __doc__)
