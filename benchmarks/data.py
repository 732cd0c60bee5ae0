"""Benchmark of lab 06's data pipeline: decoding, augmenting and loading images.

Checks correctness first, then records what ``fastdl_lab.data.bench.ROWS`` measures: PIL decode
against draft decode (nvJPEG on a GPU host), per-image against batched augmentation, the CPU cost
of one item, DataLoader images/s for num_workers x pin_memory x persistent_workers, and
pre-processing once against decoding every epoch (``bench.BENCHMARK``). Rows are appended, with
hardware columns, to ``benchmarks/results/data.csv``; rows that need a GPU say so in ``note``.

    python benchmarks/data.py [--dry-run]
"""

from _runner import run

from fastdl_lab.data import bench

if __name__ == "__main__":
    run(bench, __doc__)
