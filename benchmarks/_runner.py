"""The one command line of every technique benchmark: check, time, append rows with hardware columns."""

import argparse
import inspect

from fastdl_lab import measure


def run(technique, doc: str, argv=None) -> None:
    """``technique`` is a fastdl_lab module with ``check()``, ``benchmark(...)`` and ``BENCHMARK``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    takes_reps = "reps" in inspect.signature(technique.benchmark).parameters
    if takes_reps:
        parser.add_argument("--reps", type=int, default=10, help="timed samples per measurement")
    parser.add_argument("--dry-run", action="store_true", help="print the rows, record nothing")
    args = parser.parse_args(argv)
    technique.check()
    rows = technique.benchmark(reps=args.reps) if takes_reps else technique.benchmark()
    if not args.dry_run:
        print(f"appended {len(rows)} rows to {measure.append_results(technique.BENCHMARK['name'], rows)}")
