"""Benchmark of lab 00 measure: the measured roofline, and a vector add and matmuls placed on it.

Checks the lab's calculators first, then appends one row per measurement, with hardware columns,
to ``benchmarks/results/measure.csv``. The launch-only rows (the missing-synchronize error on a
real GPU) need a GPU and are not written on a CPU.

    python benchmarks/measure.py [--dry-run]
"""

import argparse

from fastdl_lab import measure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the rows, record nothing")
    args = parser.parse_args(argv)
    measure.check()
    rows = measure.benchmark()
    if not args.dry_run:
        print(f"appended {len(rows)} rows to {measure.append_results(measure.BENCHMARK['name'], rows)}")


if __name__ == "__main__":
    main()
