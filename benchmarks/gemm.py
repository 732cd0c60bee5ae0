"""Benchmark of lab 01 gemm: Python loops, NumPy, torch.matmul, TF32 and the Triton kernel.

Checks correctness first, then times every variant this machine can run (``gemm.BENCHMARK``)
and appends one row per measurement, with hardware columns, to ``benchmarks/results/gemm.csv``.
On a CPU the Triton and TF32 rows need a GPU and are not written.

    python benchmarks/gemm.py [--reps 10] [--dry-run]
"""

import argparse

from fastdl_lab import gemm, measure


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed samples per variant and size")
    parser.add_argument("--dry-run", action="store_true", help="print the rows, record nothing")
    args = parser.parse_args(argv)
    gemm.check()
    rows = gemm.benchmark(reps=args.reps)
    if not args.dry_run:
        print(f"appended {len(rows)} rows to {measure.append_results(gemm.BENCHMARK['name'], rows)}")


if __name__ == "__main__":
    main()
