"""GPU dataframes and GPU machine learning, written once and run on pandas/scikit-learn without a
GPU (lab 08 rapids).

- ``backend``: ``backend("auto")`` picks cuDF/CuPy/cuML or pandas/NumPy/scikit-learn and says why;
  ``to_pandas``, ``from_pandas``, ``to_numpy`` move data between them;
- ``data``: ``make_trips`` (taxi-trip-like records with the usual faults), ``write_dataset``,
  ``read_trips``, and ``tiny_trips`` with its ``TINY_SUMMARY`` worked out by hand;
- ``etl``: ``etl_ref`` and its steps (``clean``, ``normalise_payment``, ``add_time_features``,
  ``join_zones``, ``aggregate``), ``compare_tables``, and ``fare_per_km_loop`` against
  ``fare_per_km_ref``;
- ``ml``: ``features``, ``ml_ref`` (four models), ``accuracy``, ``evaluate``;
- ``scale``: ``dask_cluster`` and ``etl_dask``, the same ETL on Dask worker processes;
- ``bench``: the benchmark spec, ``benchmark`` and ``check``.

cuDF is imported only by ``backend()`` and only where a CUDA device and the package are both
present: importing this package never touches it.
"""

from fastdl_lab.tabular.backend import Backend, backend, day_of_week, from_pandas, to_numpy, to_pandas
from fastdl_lab.tabular.data import (BOROUGHS, TINY_SUMMARY, make_trips, make_zones, read_trips, read_zones,
                                     tiny_trips, write_dataset)
from fastdl_lab.tabular.etl import (KEYS, add_time_features, aggregate, clean, compare_tables, etl_ref,
                                    fare_per_km_loop, fare_per_km_ref, join_zones, normalise_payment,
                                    prepare_trips)
from fastdl_lab.tabular.ml import FEATURES, accuracy, evaluate, features, majority_rate, ml_ref
from fastdl_lab.tabular.scale import dask_cluster, etl_dask, etl_dask_compute
from fastdl_lab.tabular.bench import BENCHMARK, benchmark, check

__all__ = ["Backend", "backend", "day_of_week", "from_pandas", "to_numpy", "to_pandas", "BOROUGHS", "make_trips",
           "make_zones", "read_trips", "read_zones", "write_dataset", "KEYS", "add_time_features", "aggregate",
           "clean", "compare_tables", "etl_ref", "fare_per_km_loop", "fare_per_km_ref", "join_zones",
           "normalise_payment", "prepare_trips", "FEATURES", "accuracy", "evaluate", "features",
           "majority_rate", "ml_ref", "dask_cluster", "etl_dask", "etl_dask_compute", "BENCHMARK",
           "TINY_SUMMARY", "benchmark", "check", "tiny_trips"]
