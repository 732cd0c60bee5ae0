"""Benchmark of the labs' ungraded experiments, at the labs' full sizes.

Checks that every experiment runs at its quick size, then records what
``fastdl_lab.experiments.EXPERIMENTS`` measure: lab 01's im2col against F.conv2d, K = 4095 against
4096 and the first kernel; lab 02's compiled overhead-bound loop and FLOPs against time; lab 04's
memory pools and compiled optimizer step; lab 06's host-to-device copies and latency ladder; lab
09's distilled student, separable convolution and sparse products. Rows are appended, with
hardware columns, to ``benchmarks/results/experiments.csv``; rows that need a GPU say so in
``note``.

    python benchmarks/experiments.py [--dry-run]
"""

from _runner import run

from fastdl_lab import experiments

if __name__ == "__main__":
    run(experiments, __doc__)
