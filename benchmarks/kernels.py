"""What every Triton kernel of the course compiles to on an A100 (sm_80) and an H100 (sm_90).

No GPU needed: each kernel is compiled at the configuration its launcher picks on that GPU, and
``fastdl_lab.kernel_report`` reads registers, spills, shared memory, the tensor-core instruction and
the instructions per innermost loop from Triton's own ``ptxas`` and ``cuobjdump``. The figures are a
property of the source and the Triton version, not of a machine, so each target's file is rewritten
whole (``benchmarks/results/kernels_sm80.csv``, ``kernels_sm90.csv``); ``tests/test_kernel_report.py``
checks that they match what the kernels compile to today.

    python benchmarks/kernels.py [--target 80 --target 90] [--dry-run]
"""

import argparse
import csv
import sys
from pathlib import Path

from fastdl_lab import kernel_report

RESULTS = Path(__file__).resolve().parent / "results"


def results_path(capability: int) -> Path:
    return RESULTS / f"kernels_sm{capability}.csv"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, action="append", choices=sorted(kernel_report.SHARED_LIMIT),
                        help="compute capability to compile for (repeatable; default 80 and 90)")
    parser.add_argument("--dry-run", action="store_true", help="print the rows, write nothing")
    args = parser.parse_args(argv)
    failures = []
    for capability in args.target or kernel_report.TARGETS:
        rows = kernel_report.rows(capability)
        for found in rows:
            failures += kernel_report.problems(found)
        if not args.dry_run:
            path = results_path(capability)
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=kernel_report.COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
            print(f"wrote {len(rows)} rows to {path}")
    for failure in failures:
        print(f"problem: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
