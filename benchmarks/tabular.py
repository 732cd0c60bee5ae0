"""Benchmark of lab 08 rapids: pandas/scikit-learn here, cuDF/cuML beside them on a GPU host.

Checks correctness first, then times the row loop against vectorised pandas, each ETL step on a
million rows, the same ETL on two Dask worker processes and scikit-learn fits on 100,000 x 32, and
records the models' accuracy (``tabular.BENCHMARK``). Rows are appended, with hardware columns, to
``benchmarks/results/tabular.csv``. Without a working RAPIDS stack the cuDF/cuML rows need a GPU
and are not written.

    python benchmarks/tabular.py [--reps 5] [--dry-run]
"""

import sys
from pathlib import Path

# This folder holds distributed.py (lab 07's benchmark), which would hide the `distributed`
# package from this process and from the Dask workers it spawns (they inherit sys.path and
# re-run this file): look here last, after the installed packages.
_HERE = str(Path(__file__).resolve().parent)
sys.path.remove(_HERE)
sys.path.append(_HERE)

from _runner import run  # noqa: E402

from fastdl_lab import tabular  # noqa: E402

if __name__ == "__main__":
    run(tabular, __doc__)
