"""Benchmark of lab 10's training step: the measured matmul peak; a step of the package's GPT on
torch's parts and on the course's (seconds, tokens/s, MFU); the step's memory measured beside the
formula's prediction; activation checkpointing, bf16 autocast against fp32, and torch.compile.
Rows are appended, with hardware columns, to ``benchmarks/results/capstone.csv``.

    python benchmarks/capstone.py [--dry-run]
"""

from _runner import run

from fastdl_lab.capstone import bench

if __name__ == "__main__":
    run(bench, __doc__)
